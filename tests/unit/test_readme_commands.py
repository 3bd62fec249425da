"""CI must run exactly the test command the README gives a new user."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _readme_commands():
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_a_demo_and_a_test_command_pinning_cpu_torch():
    commands = [c for c in _readme_commands() if "pip install" in c]
    assert len(commands) == 2, "README keeps exactly two set-up commands"
    assert all("torch==2.13.0" in c for c in commands)
    assert any("pytest" in c for c in commands) and any("demo" in c for c in commands)


def test_ci_runs_the_readme_test_command():
    test_command = next(c for c in _readme_commands() if "pytest" in c and "pip install" in c)
    assert test_command.strip() in (ROOT / ".ci" / "run").read_text()
