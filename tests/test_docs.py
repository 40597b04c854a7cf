"""The documentation: the site builds (``mkdocs build --strict``, into a temporary directory, no
network), its generated reference names every config key and every CLI command and option, every
YAML and ``fedasync`` snippet of the docs and the README is checked, the README stays short, and
``fedasync --version`` prints the version.

A YAML block is a fedasync config (a fragment is merged into the default config and validated)
unless the line before it marks it: ``<!-- snippet: device-policy -->`` (validated as a device's DP
policy) or ``<!-- snippet: skip -->`` (not a fedasync file: a systemd unit, a Flower config).
"""

from __future__ import annotations

import copy
import html
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer
import yaml
from typer.testing import CliRunner

import fedasync
from fedasync.cli import app
from fedasync.config import Config, ConfigError, config_from_dict

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_README_LINES = 250


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


# -- the site -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra (mkdocs-material) is not installed")
    out = tmp_path_factory.mktemp("site")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert p.returncode == 0, f"mkdocs build --strict failed:\n{p.stdout}\n{p.stderr}"
    return out


def config_keys(model: type = Config, prefix: str = "") -> list[str]:
    """Every key of the schema as its YAML path (``a[].b`` inside a list of sections)."""
    from pydantic import BaseModel

    out = []
    for name, f in model.model_fields.items():
        key = prefix + (f.alias or name)
        out.append(key)
        ann = f.annotation
        subs = [a for a in (ann, *getattr(ann, "__args__", ())) if isinstance(a, type) and issubclass(a, BaseModel)]
        if subs:
            is_list = getattr(ann, "__origin__", None) is list
            out += config_keys(subs[0], f"{key}[]." if is_list else f"{key}.")
    return out


def cli_commands() -> list[tuple[str, click.Command]]:
    root = typer.main.get_command(app)
    out = []

    def walk(cmd, path):
        out.append((path, cmd))
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(root, "fedasync")
    return out


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def test_the_site_builds_strict_and_has_every_section(site):
    for page in ("index.html", "getting-started/index.html", "tutorials/your-own-task/index.html",
                 "tutorials/local-dp/index.html", "deploy/index.html", "howto/postgres/index.html",
                 "howto/resume/index.html", "serverless/index.html", "explanation/async-loop/index.html",
                 "explanation/threat-model/index.html", "architecture/index.html", "benchmarks/index.html",
                 "reference/configuration/index.html", "reference/cli/index.html"):
        assert (site / page).is_file(), page
    assert (site / "benchmarks/results/quickstart_comparison.png").is_file()


def test_every_config_key_is_in_the_built_reference(site):
    page = (site / "reference/configuration/index.html").read_text()
    missing = [k for k in config_keys() if f'id="{k}"' not in page]
    assert not missing, f"config keys missing from the built configuration reference: {missing}"
    assert len(config_keys()) > 100


def test_every_cli_command_and_option_is_in_the_built_reference(site):
    page = (site / "reference/cli/index.html").read_text()
    text = _text(site / "reference/cli/index.html")
    missing = []
    for path, cmd in cli_commands():
        if f"<code>{path}</code>" not in page:
            missing.append(path)
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                missing += [f"{path} {o}" for o in p.opts if o not in text]
    assert not missing, f"missing from the built CLI reference: {missing}"


# -- snippets ---------------------------------------------------------------------------


FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


def blocks(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, info, marker, text) of every fenced block; marker: the ``snippet:`` comment before it."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info, start = m.group(1), m.group(2), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mk = re.fullmatch(r"<!--\s*snippet:\s*([\w-]+)\s*-->", prev)
        body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[start + 1:j])
        out.append((start + 1, info, mk.group(1) if mk else "", body))
        i = j + 1
    return out


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_yaml(marker: str, text: str) -> None:
    """Raise (ConfigError, PolicyError, yaml.YAMLError) if the snippet is not what its marker says."""
    data = yaml.safe_load(text)
    if marker == "device-policy":
        from fedasync.privacy.policy import make_policy

        make_policy(data)
        return
    assert marker == "", f"unknown snippet marker {marker!r}"
    assert isinstance(data, dict), "a config snippet must be a mapping"
    config_from_dict(merge(Config().model_dump(mode="json", by_alias=True, exclude_none=True), data))


def yaml_snippets():
    return [pytest.param(p, ln, mk, text, id=f"{p.relative_to(ROOT)}:{ln}")
            for p in doc_files() for ln, info, mk, text in blocks(p) if info == "yaml" and mk != "skip"]


@pytest.mark.parametrize("path,line,marker,text", yaml_snippets())
def test_yaml_snippet_validates(path, line, marker, text):
    try:
        check_yaml(marker, text)
    except Exception as e:  # noqa: BLE001 - the message names the snippet
        pytest.fail(f"{path.relative_to(ROOT)}:{line}: {e}")


def test_the_yaml_check_refuses_a_bad_key_and_a_bad_policy():
    with pytest.raises(ConfigError, match="server.bufer_size"):
        check_yaml("", "server:\n  bufer_size: 4\n")
    with pytest.raises(ConfigError, match="server.concurrency"):
        check_yaml("", "server: {concurrency: -1}\n")
    from fedasync.privacy.policy import PolicyError

    with pytest.raises(PolicyError):
        check_yaml("device-policy", "epsilon: -1\n")


def commands(text: str) -> list[list[str]]:
    """The ``fedasync ...`` commands of a shell snippet, each as its words (continuations joined,
    comments, ``$`` prompts and optional ``[...]`` parts dropped, split at ``&&``, ``;``, ``|``)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"\[[^\]]*\]", "", line.strip().removeprefix("$ "))
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        cmd: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", ";", "|", "||"):
                if cmd and cmd[0] == "fedasync":
                    out.append([x for x in cmd if x != "..."])
                cmd = []
            else:
                cmd.append(w)
    return out


def check_command(words: list[str]) -> None:
    """Raise AssertionError unless the sub-command exists and its ``--help`` lists every option used."""
    cmd = typer.main.get_command(app)
    i = 1
    while isinstance(cmd, click.Group) and i < len(words) and not words[i].startswith("-"):
        assert words[i] in cmd.commands, f"{' '.join(words[:i])} has no command {words[i]!r}"
        cmd = cmd.commands[words[i]]
        i += 1
    opts = {o for p in cmd.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))
            if isinstance(p, click.Option)} | {"--help"}
    for w in words[i:]:
        if w.startswith("-") and w != "-":
            name = w.split("=", 1)[0]
            assert name in opts, f"{' '.join(words[:i])}: no option {name} (it takes {sorted(opts)})"


def shell_snippets():
    out = []
    for p in doc_files():
        for ln, info, mk, text in blocks(p):
            if mk == "skip" or info not in ("bash", "sh", "console", ""):
                continue
            if info == "" and "$ fedasync" not in text:
                continue
            for words in commands(text):
                out.append(pytest.param(words, id=f"{p.relative_to(ROOT)}:{ln}:{' '.join(words[:3])}"))
    return out


@pytest.mark.parametrize("words", shell_snippets())
def test_fedasync_command_in_docs_parses(words):
    check_command(words)


def test_the_command_check_refuses_an_unknown_option_and_command():
    check_command(["fedasync", "simulate", "--set", "a=1", "--out", "x"])
    with pytest.raises(AssertionError, match="--bogus"):
        check_command(["fedasync", "simulate", "--bogus"])
    with pytest.raises(AssertionError, match="nosuch"):
        check_command(["fedasync", "ledger", "nosuch"])
    assert commands("x && fedasync runs --store u  # c\n$ fedasync simulate \\\n  --out d [--data f]") == \
        [["fedasync", "runs", "--store", "u"], ["fedasync", "simulate", "--out", "d"]]


def test_snippets_are_found():
    assert len(yaml_snippets()) >= 5 and len(shell_snippets()) >= 30


# -- README and version ------------------------------------------------------------------


def test_readme_is_short_and_links_into_the_site():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).is_file() or target == "docs/tracking.md", target
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")


def test_version_option_prints_the_version():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0
    assert r.output.strip() == f"fedasync {fedasync.__version__}"
