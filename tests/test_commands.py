"""The commands: every console script of setup.py names a ``main`` that imports, each
``tools/*.py`` runs the same ``main`` as its command module, and a user error is one line
with exit status 2 while any other exception keeps its traceback."""

import ast
import importlib
import os
import subprocess
import sys

import pytest

from megatron_jreg.commands import exit_codes
from megatron_jreg.errors import ConfigError, InputError, UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tools/X.py -> megatron_jreg.commands.Y
TOOLS = {
    "compare_seeds": "compare_seeds",
    "convert_from_hf": "convert_from_hf",
    "convert_to_hf": "convert_to_hf",
    "eval_downstream": "eval_downstream",
    "eval_jump": "eval_jump",
    "make_demo_corpus": "make_demo_corpus",
    "preprocess_data": "preprocess",
    "train_tokenizer": "train_tokenizer",
}


def console_scripts():
    """{name: "module:function"} of setup.py's console_scripts, read without running it."""
    with open(os.path.join(REPO, "setup.py")) as f:
        tree = ast.parse(f.read())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "console_scripts":
                    for item in ast.literal_eval(value):
                        name, target = (part.strip() for part in item.split("=", 1))
                        found[name] = target
    return found


def test_console_scripts_are_declared():
    scripts = console_scripts()
    assert "megatron-jreg-train" in scripts
    assert {f"megatron_jreg.commands.{m}:main" for m in TOOLS.values()} <= set(scripts.values())
    for name, target in scripts.items():
        assert name.startswith("megatron-jreg-") and target.startswith("megatron_jreg.commands."), \
            (name, target)


@pytest.mark.parametrize("name", sorted(console_scripts()))
def test_console_script_names_an_importable_main(name):
    module, function = console_scripts()[name].split(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_every_tool_is_listed():
    tools = sorted(n[:-3] for n in os.listdir(os.path.join(REPO, "tools")) if n.endswith(".py"))
    assert tools == sorted(TOOLS)


def _help(argv):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               COLUMNS="100")
    proc = subprocess.run([sys.executable, *argv, "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_tool_alias_runs_the_command(tool):
    """``python tools/X.py --help`` is ``python -m megatron_jreg.commands.Y --help`` apart
    from the program name (the file's name where the parser takes it from argv[0])."""
    module = TOOLS[tool]
    by_tool = _help([f"tools/{tool}.py"])
    by_module = _help(["-m", f"megatron_jreg.commands.{module}"])
    # the usage lines wrap at another place for a name of another length
    assert (" ".join(by_tool.replace(f"{tool}.py", "PROG").split())
            == " ".join(by_module.replace(f"{module}.py", "PROG").split()))


def test_user_errors_share_one_root():
    assert issubclass(InputError, UserError) and issubclass(ConfigError, UserError)
    assert issubclass(UserError, ValueError)


def test_run_command_words_a_user_error_and_returns_usage(capsys):
    def body():
        raise InputError("--flag x: no such file")

    assert exit_codes.run_command(body, prefix="tool: error") == exit_codes.USAGE == 2
    assert capsys.readouterr().err == "tool: error: --flag x: no such file\n"
    assert exit_codes.run_command(body, say=False) == 2
    assert capsys.readouterr().err == ""
    assert exit_codes.run_command(lambda: exit_codes.OK) == 0


def test_run_command_lets_other_exceptions_through():
    def body():
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        exit_codes.run_command(body)
