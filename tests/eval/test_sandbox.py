from eval.extract import extract_program, parse_printed_objective
from eval.harness import is_pass
from eval.sandbox import isolation_level, run_batch, run_program


def test_extract_last_block_and_unterminated():
    text = "a\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```"
    assert extract_program(text).strip() == "print(2)"
    assert extract_program("```python\nx = 1\nprint(x)").strip() == "x = 1\nprint(x)"
    assert extract_program("no code here") is None


def test_parse_objective():
    assert parse_printed_objective("Optimal objective: 12.5\n") == 12.5
    assert parse_printed_objective("objective 1\nOptimal objective: -3e2") == -300.0
    assert parse_printed_objective("value: 4") is None


def test_pass_rule():
    assert is_pass(100.0000001, 100.0, 1e-6) and not is_pass(100.1, 100.0, 1e-6) and not is_pass(None, 1.0, 1e-6)


def test_run_program_ok_error_timeout_memory():
    ok = run_program("print('Optimal objective:', 6 * 7)")
    assert ok.status == "ok" and ok.objective == 42 and ok.isolation == isolation_level()
    err = run_program("raise ValueError('x')")
    assert err.status == "error" and "ValueError" in err.stderr_tail
    slow = run_program("while True: pass", timeout_s=1.0)
    assert slow.status == "timeout" and slow.seconds < 10
    mem = run_program("x = bytearray(3 * 1024**3)\nprint('Optimal objective: 1')", memory_mb=512)
    assert mem.status == "error" and "MemoryError" in mem.stderr_tail
    none = run_program("print('hello')")
    assert none.status == "no_objective"


def test_program_runs_in_private_dir_without_network():
    res = run_program("import os\nprint(os.getcwd())\nprint('Optimal objective: 1')")
    assert "trex-exec-" in res.stdout_tail
    if isolation_level().startswith("netns"):
        code = ("import socket\ns = socket.socket()\ns.settimeout(2)\n"
                "try:\n    s.connect(('127.0.0.1', 9))\n    print('connected')\nexcept OSError as e:\n    print('blocked', e)\n"
                "print('Optimal objective: 1')")
        out = run_program(code).stdout_tail
        assert "blocked" in out


def test_run_batch_isolates_namespaces_and_failures():
    res = run_batch(["x = 5\nprint('Optimal objective:', x)", "print('Optimal objective:', x)", "import sys; sys.exit(0)"])
    assert res[0]["status"] == "ok" and res[0]["objective"] == 5
    assert res[1]["status"] == "error" and "NameError" in res[1]["error"]
    assert res[2]["status"] == "no_objective"


def test_reported_status_and_the_infeasible_rule():
    from eval.extract import parse_printed_status
    from eval.harness import is_correct

    assert parse_printed_status("Optimal objective: 3\n") == "optimal"
    assert parse_printed_status("Status: Infeasible\n") == "infeasible"
    assert parse_printed_status("Status: unbounded") == "unbounded"
    assert parse_printed_status("Model status: Primal infeasible or unbounded") == "infeasible_or_unbounded"
    assert parse_printed_status("done") is None
    assert is_correct(None, "infeasible", None, "infeasible", 1e-6)
    assert not is_correct(None, "infeasible_or_unbounded", None, "infeasible", 1e-6)
    assert not is_correct(5.0, "optimal", None, "infeasible", 1e-6)
    assert not is_correct(None, "infeasible", 5.0, "optimal", 1e-6)
    assert is_correct(5.0, "optimal", 5.0, "optimal", 1e-6)
    res = run_program("print('Status: Infeasible')")
    assert res.status == "ok" and res.reported == "infeasible" and res.objective is None
