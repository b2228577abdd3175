"""The RL reward: 1 only for an attested optimum without side effects; printing, crashing, timing out get 0."""

from eval.rewards import ProgramReward

SOLVE = ("import json, highspy\nd = json.load(open('data.json'))\nh = highspy.Highs()\nh.silent()\n"
         "x = h.addVariable(lb=0, ub=d['ub'])\nh.maximize(7 * x)\nprint('Optimal objective:', 42)\n")
ROW = {"files": '{"data.json": "{\\"ub\\": 6}"}', "objective": "42.0", "status": "optimal"}


def block(code: str) -> str:
    return f"<think>\nmodel it\n</think>\n```python\n{code}```"


def test_only_an_attested_optimum_without_side_effects_earns_the_reward():
    answers = {
        "right": block(SOLVE),
        "prints_the_right_number": block("print('Optimal objective: 42')\n"),
        "right_but_connects": block("import socket\ntry:\n    socket.create_connection(('10.0.0.1', 80), 1)\n"
                                    "except OSError:\n    pass\n" + SOLVE),
        "wrong_value": block(SOLVE.replace("7 * x", "6 * x")),
        "crashes": block("raise ValueError('no')\n"),
        "hangs": block("while True:\n    pass\n"),
        "no_code": "I think the answer is 42.",
    }
    for partial in (0.0, 0.1):
        reward = ProgramReward(timeout_s=2.0, workers=2, format_reward=partial, executes_reward=partial,
                               feasible_reward=partial)
        got = dict(zip(answers, reward([ROW] * len(answers), list(answers.values()))))
        assert got["right"] == {"reward": 1.0, "correct": True, "outcome": "ok", "side_effects": []}
        assert got["right_but_connects"]["reward"] == 0.0 and "socket.connect" in got["right_but_connects"]["side_effects"]
        for name in ("prints_the_right_number", "crashes", "hangs", "no_code"):
            assert got[name]["reward"] == 0.0 and not got[name]["correct"], (name, got[name])
        assert got["hangs"]["outcome"] == "timeout"
        assert got["wrong_value"]["reward"] == 3 * partial and not got["wrong_value"]["correct"]
