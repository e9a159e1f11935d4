"""The documentation site builds cleanly, covers every module, and its examples run.

`mkdocs build --strict` fails on a reference to a module or object that does not exist,
on a cross-reference that does not resolve and on a docstring whose parameters do not
match the signature (mkdocs.yml, docs/).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def read(*path: str) -> str:
    with open(os.path.join(DOCS, *path), encoding="utf-8") as f:
        return f.read()


@pytest.mark.timeout(180)
def test_the_site_builds_strictly(tmp_path):
    start = time.perf_counter()
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert build.returncode == 0, build.stdout + build.stderr
    assert (tmp_path / "index.html").exists()
    assert (tmp_path / "reference" / "runtime" / "index.html").exists()
    print(f"mkdocs build --strict: {time.perf_counter() - start:.1f}s")


def documented_modules() -> set[str]:
    reference = os.path.join(DOCS, "reference")
    return {name for page in os.listdir(reference) if page.endswith(".md")
            for name in re.findall(r"^::: ([\w.]+)", read("reference", page), re.MULTILINE)}


@pytest.mark.parametrize("package", ["sebulba", "agents"])
def test_every_module_has_a_reference(package):
    missing = []
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for file in files:
            if file.endswith(".py") and file != "__init__.py":
                relative = os.path.relpath(os.path.join(folder, file[:-3]), ROOT)
                missing.append(relative.replace(os.sep, "."))
    missing = sorted(set(missing) - documented_modules())
    assert not missing, f"add these modules to a page of docs/reference/: {missing}"


def test_the_public_api_page_names_every_public_name():
    import sebulba

    page = read("reference", "index.md")
    missing = [name for name in sebulba.__all__ if f"[`sebulba.{name}`]" not in page]
    assert not missing, f"add these names to docs/reference/index.md: {missing}"


def python_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", read(page), re.MULTILINE | re.DOTALL)


def shortened(code: str) -> str:
    """The example with a run of a few thousand env steps."""
    return re.sub(r"total_env_steps=[\d_]+", "total_env_steps=2_000", code)


@pytest.mark.timeout(300)
def test_the_agent_of_writing_an_agent_runs(no_leftovers):
    code, _ = python_blocks("writing-an-agent.md")
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(shortened(code), "writing-an-agent.md", "exec"), namespace)
    result = namespace["result"]
    assert result.consumed >= 2_000 and result.learner_updates > 0


@pytest.mark.timeout(300)
def test_the_agent_of_writing_an_agent_trains_and_resumes_with_the_launcher(tmp_path):
    """The page's script registers the page's agent and runs examples.train: flags of its
    config, a checkpoint, and a resume (which once needed the agent to keep `.config`)."""
    agent, script = python_blocks("writing-an-agent.md")
    (tmp_path / "linear.py").write_text(agent[:agent.index("config = sebulba.Config")])
    (tmp_path / "train_linear.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, str(tmp_path)])
    logdir = tmp_path / "run"

    def launch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "train_linear.py", "--agent=linear", f"--logdir={logdir}",
             "--envs_per_group=8", "--steps_per_cycle=16", "--progress=false",
             "--log_every_seconds=0", *args],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    first = launch("--linear_learning_rate=0.02", "--total_env_steps=1024")
    assert first.returncode == 0, first.stderr[-3000:]
    # --helpshort lists the script's key flags: the launcher's and its agent's
    short = launch("--helpshort").stdout
    assert "--linear_learning_rate" in short and "--envs_per_group" in short, short
    # Async env workers import the script again (spawn): its guard keeps the run out.
    again = launch("--linear_learning_rate=0.05", "--total_env_steps=2048", "--resume",
                   "--vectorization=async")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {logdir / 'checkpoints'} at 1,024 env steps" in again.stdout
    assert ("settings that differ from the checkpoint's: --linear_learning_rate 0.02 -> "
            "0.05") in again.stdout


def test_agents_register_under_a_flag_prefix_before_the_launcher_is_imported():
    import dataclasses

    from agents.registry import AGENTS, register
    from agents.spg import SPG, SPGConfig

    with pytest.raises(ValueError, match=r"lowercase letters, digits and _ .* got 'My-Agent'"):
        register("My-Agent", SPGConfig, SPG)
    with pytest.raises(ValueError, match="agent 'ppo' is registered already"):
        register("ppo", SPGConfig, SPG)
    with pytest.raises(TypeError, match="config_class must be a dataclass"):
        register("mine", dict, SPG)
    register("spg", SPGConfig, SPG)  # the same entry again: nothing to do
    import examples.train  # noqa: F401 - the launcher's flags are defined from here on

    with pytest.raises(RuntimeError, match="before importing examples.train"):
        register("mine", dataclasses.make_dataclass("C", []), SPG)
    assert "mine" not in AGENTS


@pytest.mark.timeout(300)
def test_the_source_of_env_sources_runs(no_leftovers):
    from sebulba import envs

    source, run = python_blocks("env-sources.md")[-2:]
    namespace: dict = {"__name__": "docs_example"}
    try:
        exec(compile(source, "env-sources.md", "exec"), namespace)
        assert "sign" in envs.names()
        exec(compile(shortened(run), "env-sources.md", "exec"), namespace)
    finally:
        envs.unregister("sign")
    result = namespace["result"]
    assert result.consumed >= 2_000 and result.episodes
