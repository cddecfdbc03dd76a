"""The commands, files and links the README and the operator guide show are true.

Every command in those docs (their sh blocks, and inline code that starts with a command) is
checked here or, where it needs `make run`'s stack, by tests/e2e/test_localstack.py; the few
that cannot run on this machine are listed in OFFLINE with the reason, and a command of a
kind nobody checks fails the test, so that a new one gets a check or a reason.
"""

from __future__ import annotations

import argparse
import glob
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc import cli
from extproc.cli import _parser
from extproc.configparse import parse_config
from tests import doccommands as dc
from tests.doccommands import ROOT, Command

VENV_BIN = Path(sys.executable).parent
ENVOY = VENV_BIN / "envoy"
# Paths that stand for an operator's own: the file each stands for here.
SITE_PATHS = {"/etc/kvgate/kvgate.yaml": "deploy/kvgate.yaml",
              "kvgate-config.yaml": "deploy/k8s/kvgate-config.yaml"}
# Commands that cannot be run here, by their first words, and why; their repository paths
# are still checked.
OFFLINE = {
    "kubectl": "needs a Kubernetes cluster; tests/deploy/test_k8s.py, test_istio.py and "
               "test_inferencepool.py load the manifests it applies",
    "docker": "needs a Docker daemon; tests/deploy/test_dockerfile.py checks the Dockerfile",
    "istioctl": "needs an Istio installation",
    "kill": "a signal to a running kvgate; tests/integration/test_serve_cli.py sends SIGHUP and SIGTERM",
    "cp": "plain shell: the atomic rename hot reload relies on; tests/integration/"
          "test_server_reload.py renames files over the watched one",
    "promtool": "tests/deploy/test_alert_rules.py runs `promtool check rules` on the shipped rules",
    "make run": "long-running: tests/e2e/test_localstack.py starts the stack as `make run` does",
    "make test": "the whole suite: it runs this test",
    "kvgate serve": "long-running: its arguments are parsed here, and tests/integration/"
                    "test_serve_cli.py runs it",
}
# Written by `make` and the stack, ignored by git: absent from a fresh clone.
GENERATED = ("bench/results/local", "run")
PATH = re.compile(r"^(?:\.\./)*(deploy|docs|bench|tests|extproc|sim|kvgate_testkit)/[\w./*{}-]*$")
PLACEHOLDER = re.compile(r"[\[\]|<>]|\.\.\.|^[A-Z][A-Z_:]*(\.yaml)?$")


def every_command() -> list[Command]:
    return [c for doc in dc.DOCS for c in dc.commands(doc)]


def kind(command: Command) -> str:
    """kind names the check a command gets: its first word, or its first two where those differ."""
    words = command.words
    if words[0] in ("python", "python3", ".venv/bin/python") and words[1:3] == ["-m", "extproc"]:
        return "kvgate"
    if words[0] in ("python", "python3", ".venv/bin/python"):
        return "python"
    two = " ".join(words[:2])
    return two if two in OFFLINE else words[0]


def make_targets() -> tuple[set[str], set[str]]:
    """make_targets returns the Makefile's targets and the variables it reads."""
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):", text, re.M))
    variables = set(re.findall(r"^(\w+) \??=", text, re.M))
    return targets, variables


def repo_path_exists(word: str, base: Path = ROOT) -> bool:
    word = word.split("#", 1)[0].rstrip("/.,:")
    if word in GENERATED or word.startswith(tuple(g + "/" for g in GENERATED)):
        return True
    if "{" in word:  # deploy/x/{a,b}: each
        head, rest = word.split("{", 1)
        options, tail = rest.split("}", 1)
        return all(repo_path_exists(head + o + tail, base) for o in options.split(","))
    return bool(glob.glob(str(base / word)))


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def kvgate_argv(command: Command) -> list[str]:
    words = command.words
    return words[3:] if words[0] != "kvgate" else words[1:]


def is_synopsis(argv: list[str]) -> bool:
    """is_synopsis tells a synopsis (``FILE``, ``[--mode MODE]``, ``text|json``) from a
    command to run (a lone ``>`` or ``|`` is the shell's)."""
    return any(PLACEHOLDER.search(w) for w in argv if w not in (">", "|"))


@pytest.mark.parametrize("doc", dc.DOCS)
def test_every_command_is_checked_or_says_why_not(doc):
    checked = {"make", "kvgate", "envoy", "curl", "python", "pytest"}
    unchecked = [c.text for c in dc.commands(doc) if kind(c) not in checked | set(OFFLINE)]
    assert unchecked == [], "a command of a new kind: check it here, or add it to OFFLINE with the reason"


def test_every_make_target_and_variable_the_docs_name_exists():
    targets, variables = make_targets()
    for c in every_command():
        if kind(c) != "make":
            continue
        for word in c.words[1:]:
            if "=" in word:
                assert word.split("=", 1)[0] in variables, c
            else:
                assert [t for t in targets if glob.fnmatch.fnmatch(t, word)], c  # type: ignore[attr-defined]


def test_every_kvgate_synopsis_names_a_subcommand_and_its_options():
    from sim.cli import build_parser as sim_parser
    subs = subparsers()
    seen = 0
    for c in every_command():
        argv = kvgate_argv(c)
        if kind(c) != "kvgate" or not argv:
            continue  # `kvgate` alone: the command's name
        assert argv[0] in subs, c
        parser = sim_parser() if argv[0] == "sim" else subs[argv[0]]
        for word in argv[1:]:
            for option in re.findall(r"--[\w-]+", word):
                assert option in options_of(parser), (option, c)
        seen += 1
    assert seen >= 10


def concrete_kvgate_commands() -> list[Command]:
    return [c for c in every_command()
            if kind(c) == "kvgate" and len(kvgate_argv(c)) > 1 and not is_synopsis(kvgate_argv(c))
            and c.words[-1] != "--help"]


def on_site(text: str) -> str:
    for site, here in SITE_PATHS.items():
        text = re.sub(rf"(?<![\w/.-]){re.escape(site)}", str(ROOT / here), text)
    return text


def test_the_concrete_kvgate_commands_run_as_the_docs_say(tmp_path):
    """Each command with real arguments is parsed by kvgate's own parser; check-config and
    envoy-filter run, in the docs' order in one folder (one writes the file the next reads),
    and a whole Envoy file they write passes `envoy --mode validate`."""
    ran = []
    for c in concrete_kvgate_commands():
        argv = kvgate_argv(c)
        redirect = argv.index(">") if ">" in argv else None
        _parser().parse_args([on_site(w) for w in argv[:redirect]])
        if argv[0] == "serve":
            continue  # OFFLINE["kvgate serve"]
        done = subprocess.run(["bash", "-c", on_site(c.text)], cwd=tmp_path, capture_output=True, text=True,
                              env={"PATH": f"{VENV_BIN}:/usr/bin:/bin"}, timeout=60)
        assert done.returncode == 0, (c, done.stderr)
        if redirect is not None and "--bootstrap" in argv:
            written = tmp_path / argv[redirect + 1]
            valid = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(written)],
                                   capture_output=True, text=True, timeout=60)
            assert valid.returncode == 0, (c, valid.stdout[-2000:], valid.stderr[-2000:])
        ran.append(argv[0])
    assert {"check-config", "envoy-filter"} <= set(ran)


@pytest.mark.parametrize("help_command", ["kvgate sim --help"])
def test_the_help_the_docs_point_to_answers(help_command):
    assert help_command in [c.text for c in every_command()]
    done = subprocess.run([str(VENV_BIN / "kvgate"), *help_command.split()[1:]],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--enable-prefix-caching" in done.stdout


def test_envoy_validates_the_files_the_docs_name():
    """`envoy --mode validate` (as the docs show it, on a shipped file where they write FILE)."""
    shown = [c for c in every_command() if kind(c) == "envoy"]
    assert shown and all(c.words[:3] == ["envoy", "--mode", "validate"] for c in shown)
    files = {w for c in shown for w in c.words[3:] if PATH.match(w)} or {"deploy/envoy.yaml"}
    for name in sorted(files):
        done = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(ROOT / name)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (name, done.stderr[-2000:])


def test_the_local_stack_flags_the_readme_names_exist():
    shown = [c for c in every_command() if kind(c) == "python"]
    assert shown, "the README names `.venv/bin/python -m extproc.localstack --pool-level`"
    for c in shown:
        assert c.words[1:3] == ["-m", "extproc.localstack"], c
        done = subprocess.run([sys.executable, "-m", "extproc.localstack", "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        for option in c.words[3:]:
            assert option in done.stdout, c


def test_every_curl_talks_to_the_local_stack_whose_test_runs_it():
    curls = [c for c in every_command() if kind(c) == "curl"]
    assert curls and all(c in dc.local_stack_commands() for c in curls)


def test_the_pytest_marker_the_readme_names_is_declared():
    (c,) = [c for c in every_command() if kind(c) == "pytest"]
    marker = c.words[-1].removeprefix("not ")
    assert f'"{marker}:' in (ROOT / "pyproject.toml").read_text()


def test_every_repository_path_a_command_names_exists():
    for c in every_command():
        for word in c.words:
            if kind(c) == "kubectl" and re.fullmatch(r"deploy/[\w-]+", word):
                continue  # kubectl's short name of a Deployment, not a folder
            word = on_site(word).removeprefix(str(ROOT) + "/")
            if PATH.match(word):
                assert repo_path_exists(word), (word, c)


@pytest.mark.parametrize("doc", dc.DOCS)
def test_every_file_the_doc_names_exists(doc):
    named = [s for s in dc.spans(doc) if PATH.match(s)]
    assert named or doc == "docs/metrics.md"
    base = (ROOT / doc).parent if doc.startswith("docs/") else ROOT
    missing = [s for s in named if not (repo_path_exists(s) or repo_path_exists(s, base))]
    assert missing == []


@pytest.mark.parametrize("doc", dc.DOCS)
def test_every_link_reaches_a_file_and_its_heading(doc):
    here = (ROOT / doc).parent
    for target in dc.links(doc):
        path, _, anchor = target.partition("#")
        file = (here / path).resolve() if path else ROOT / doc
        assert file.exists(), target
        if anchor:
            assert anchor in dc.anchors(str(file.relative_to(ROOT))), target


def test_every_kvgate_configuration_the_docs_show_is_valid():
    shown = [b for doc in dc.DOCS for b in dc.blocks(doc, "yaml")]
    configs = [yaml.safe_load(b) for b in shown if re.match(r"pools:", b)]
    assert configs, "the README's example configuration"
    for data in configs:
        parse_config(data)


def test_the_readme_begins_with_the_two_commands():
    first = (ROOT / "README.md").read_text().split("\n```sh\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in first.splitlines()] == [["make", "run"], ["make", "test"]]


def deploy_comment_checks() -> list[tuple[Path, list[str]]]:
    """deploy_comment_checks returns the `kvgate check-config` commands that comments in
    deploy/ tell an operator to run (synopses with FILE left out), with the file's folder."""
    found = []
    for path in sorted((ROOT / "deploy").rglob("*.yaml")):
        for m in re.finditer(r"^\s*#.*?(kvgate check-config [^`\n]+?)\.?$", path.read_text(), re.M):
            argv = m.group(1).split()[1:]
            if not is_synopsis(argv):
                found.append((path.parent, argv))
    return found


def test_the_check_config_commands_deploy_comments_give_pass(capsys):
    """Run where the file is (a ConfigMap's comment names it by its own name), else at the
    repository's root: each passes, as the comment promises."""
    checks = deploy_comment_checks()
    assert len(checks) >= 3  # deploy/kvgate.yaml and the two ConfigMaps that carry kvgate's file
    for folder, argv in checks:
        base = folder if (folder / argv[1]).exists() else ROOT
        assert cli.main([argv[0], str(base / argv[1]), *argv[2:]]) == 0, (folder, argv, capsys.readouterr().err)
