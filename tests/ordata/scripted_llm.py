"""A scripted OpenAI-compatible server for the data engine's LLM tests (a real HTTP server on localhost).

It answers ``POST /<endpoint>/v1/chat/completions`` the way the test scripted it, recognising the data engine's
prompts (a rewrite, a forward-modelling or a distillation request, and their repair turns) and the instance
they are about (by its question, template or rewritten). Every request is recorded server-side, so a test can
check that a second run sent none.

Rewrite behaviours (one per turn: the first answer, then the repair): ``good`` (a paraphrase keeping every
number), ``drop`` (the first number dropped), ``alter`` (the first number changed), ``add`` (a number added),
``nokey`` (a DPS problem's first data key no longer named).
Forward / distillation behaviours (per turn, or per sample): ``good`` (the instance's verified program),
``long`` (the same, with a longer reasoning), ``wrong`` (solves the instance, then another model: attested
mismatch), ``crash`` (raises), ``malicious`` (writes to the host, calls this server, prints the optimum without
solving), ``no_think``, ``truncated`` (finish_reason length), ``none`` (no program).
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from eval.prompts import REWRITE_SYSTEM
from ordata.llm.client import request_seed

WRONG_TAIL = ("\nimport highspy as _hs\n_h = _hs.Highs()\n_h.silent()\n_x = _h.addVariable(lb=0, ub=1)\n"
              "_h.maximize(_x)\nprint('Optimal objective:', _h.getInfo().objective_function_value)\n")
_NUM = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?!\w)")


@dataclass
class Script:
    rows: list[dict]  # the instances (template question, program, objective, files)
    data_seed: int
    rewrite: dict[str, list[str]] = field(default_factory=dict)  # row id -> behaviour per turn
    forward: dict[str, list[str]] = field(default_factory=dict)  # row id -> behaviour per turn
    distill: dict[str, list[str]] = field(default_factory=dict)  # row id -> behaviour per sample
    host_file: str = "/tmp/never"  # what a malicious program tries to create on the host
    fail: dict[str, int] = field(default_factory=dict)  # endpoint -> requests to answer with HTTP 500
    throttle: dict[str, int] = field(default_factory=dict)  # endpoint -> requests to answer with 429
    hold_s: float = 0.0  # hold each request until another arrives or this passes (to observe concurrency)
    hang: str = "\0"  # a request whose last message contains this never gets an answer in time

    def __post_init__(self):
        self.by_question = {r["question"].strip(): r for r in self.rows}


class ScriptedServer:
    def __init__(self, script: Script):
        self.script = script
        self.requests: list[dict] = []  # every chat request received: endpoint, kind, row id, turn / sample
        self.pwned: list[str] = []  # anything a sandboxed program managed to send here
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.inflight, self.max_inflight = Counter(), Counter()  # per endpoint and 'all'
        self.app = self._app()

    # ---------------------------------------------------------------------------------------------- counts
    def count(self, **match) -> int:
        with self.lock:
            return sum(all(r.get(k) == v for k, v in match.items()) for r in self.requests)

    def kinds(self) -> Counter:
        with self.lock:
            return Counter(r["kind"] for r in self.requests)

    # -------------------------------------------------------------------------------------------- answers
    def _row(self, question: str) -> dict:
        return self.script.by_question[question.strip()]

    def _rewrite(self, row: dict, behaviour: str) -> str:
        q = row["question"]
        if behaviour == "good":
            text = "Picture the following situation, described by the person who runs it.\n\n" + q
        elif behaviour == "drop":
            text = _NUM.sub("some", q, count=1)
        elif behaviour == "alter":
            text = _NUM.sub(lambda m: str(int(float(m.group()) + 1)), q, count=1)
        elif behaviour == "add":
            text = q + "\n\nThe company was founded 12345 days ago."
        elif behaviour == "nokey":  # a DPS rewrite that no longer names the first key of the data file
            key = next(iter(json.loads(json.loads(row["files"])["data.json"])))
            text = "In other words: " + re.sub(rf"`{re.escape(key)}`", "the first list", q)
        else:
            raise ValueError(behaviour)
        if behaviour == "good":
            self.script.by_question[text.strip()] = row
        return f"Sure.\n<problem>\n{text}\n</problem>"

    def _answer(self, row: dict, behaviour: str) -> tuple[str, str]:
        prog = row["program"]
        think = "The decisions are the quantities; the objective and constraints follow from the data."
        if behaviour == "long":
            think = think + " Let me double-check every number against the text once more." * 5
        elif behaviour == "wrong":
            prog = prog + WRONG_TAIL
        elif behaviour == "crash":
            prog = "raise RuntimeError('boom: the model could not be built')\n"
        elif behaviour == "malicious":
            truth = row["objective"]
            port = self.port
            prog = ("import urllib.request\n"
                    "try:\n"
                    f"    open({self.script.host_file!r}, 'w').write('owned')\n"
                    "except OSError as e:\n"
                    "    print('host file:', type(e).__name__)\n"
                    "try:\n"
                    f"    urllib.request.urlopen('http://127.0.0.1:{port}/pwned', timeout=2)\n"
                    "except Exception as e:\n"
                    "    print('network:', type(e).__name__)\n"
                    f"print('Optimal objective:', {truth!r})\n")
        body = f"<model>\nmaximise the objective subject to the constraints of the text\n</model>\n" \
               f"<python>\n```python\n{prog}```\n</python>"
        if behaviour == "none":
            body = "<model>\nx\n</model>\nI cannot write the program."
        text = body if behaviour == "no_think" else f"<think>\n{think}\n</think>\n{body}"
        return text, "length" if behaviour == "truncated" else "stop"

    def respond(self, endpoint: str, body: dict) -> tuple[int, dict, dict]:
        msgs = body["messages"]
        last = msgs[-1]["content"]
        users = sum(m["role"] == "user" for m in msgs)
        s = self.script
        rec = {"endpoint": endpoint, "kind": "other", "seed": body.get("seed")}
        reasoning = None
        with self.cond:
            self.requests.append(rec)
            if s.fail.get(endpoint, 0) > 0:
                s.fail[endpoint] -= 1
                return 500, {"error": {"message": "scripted failure"}}, {}
            if s.throttle.get(endpoint, 0) > 0:
                s.throttle[endpoint] -= 1
                return 429, {"error": {"message": "slow down"}}, {"retry-after": "0"}
            for k in (endpoint, "all"):
                self.inflight[k] += 1
                self.max_inflight[k] = max(self.max_inflight[k], self.inflight[k])
            self.cond.notify_all()
            if s.hold_s:
                self.cond.wait_for(lambda: self.inflight["all"] > 1, timeout=s.hold_s)
        try:
            if s.hang in last:
                threading.Event().wait(2)  # never set: answers 2 s late, past the client's timeout in that test
            if msgs[0]["content"] == REWRITE_SYSTEM:
                question = msgs[1]["content"].split("<problem>\n", 1)[1].rsplit("\n</problem>", 1)[0]
                row = self._row(question)
                rec.update(kind="rewrite", id=row["id"], turn=users)
                text, finish = self._rewrite(row, s.rewrite.get(row["id"], ["good"])[users - 1]), "stop"
            elif len(msgs) > 1 and "# Problem\n" in msgs[1]["content"]:
                user = msgs[1]["content"].split("# Problem\n", 1)[1]
                question = re.split(r"\n\n(?:# Data\n|Requirements for the program:)", user, maxsplit=1)[0]
                row = self._row(question)
                if body["temperature"] == 0:  # the forward-modelling check
                    rec.update(kind="forward", id=row["id"], turn=users)
                    text, finish = self._answer(row, s.forward.get(row["id"], ["good"])[users - 1])
                else:
                    j = body["seed"] - request_seed(s.data_seed, row["id"], "distill")
                    rec.update(kind="distill", id=row["id"], sample=j)
                    text, finish = self._answer(row, s.distill.get(row["id"], ["good"] * (j + 1))[j])
            elif "[reasoning]" in last:  # a reasoning server: the reasoning in its own field
                text, finish, reasoning = "Answer.", "stop", "Because."
            else:
                text, finish = "Hello.", "stop"
        finally:
            with self.cond:
                self.inflight[endpoint] -= 1
                self.inflight["all"] -= 1
        usage = {"prompt_tokens": sum(len(m["content"].split()) for m in msgs), "completion_tokens": len(text.split())}
        message = {"role": "assistant", "content": text, **({"reasoning_content": reasoning} if reasoning else {})}
        return 200, {"id": "scripted", "object": "chat.completion", "model": body.get("model"),
                     "choices": [{"index": 0, "message": message,
                                  "finish_reason": finish}], "usage": usage}, {}

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/{endpoint}/v1/chat/completions")
        def chat(endpoint: str, body: dict):
            status, payload, headers = self.respond(endpoint, body)
            return JSONResponse(payload, status_code=status, headers=headers)

        @app.api_route("/pwned", methods=["GET", "POST"])
        def pwned(request: Request):
            with self.lock:
                self.pwned.append(str(request.client))
            return {"ok": True}

        return app

    port = 0
