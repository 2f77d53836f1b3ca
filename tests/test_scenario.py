"""The one helper that runs a scenario in a fresh process (tests/scenario.py): a script
elsewhere imports the repository and tests/ by it, a scenario is named on the command
line, and a name it lacks is said with the ones it has."""


from scenario import scenario, start

SCRIPT = '''import os, sys
import somatize
from scenario import play


def hello(*words):
    print(" ".join(words), os.getcwd())


def _hidden():
    print("never")


play(globals(), sys.argv)
'''


def test_a_scenario_runs_in_a_fresh_process_with_the_repository_importable(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = scenario(script, "hello", "a", "b", cwd=tmp_path, timeout=60)
    assert done.stdout == f"a b {tmp_path}\n"
    proc = start(script, "hello", "c", cwd=tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (0, f"c {tmp_path}\n")


def test_a_scenario_the_script_lacks_is_said_with_those_it_has(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    for name in ("nope", "_hidden"):
        done = scenario(script, name, cwd=tmp_path, timeout=60, expect_rc=1)
        assert f"no scenario {name!r}; its scenarios are ['hello']" in done.stderr
    try:
        scenario(script, "nope", cwd=tmp_path, timeout=60)
    except AssertionError as e:
        assert "script.py nope: exit code 1, not 0" in str(e) and "no scenario" in str(e)
    else:
        raise AssertionError("a failed scenario passed")
