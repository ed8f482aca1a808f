"""What README.md and docs/*.md show a user runs as written: links and anchors resolve, the
files named in backticks exist, the environment table matches the variables the code reads,
every `mha ...` command in a fenced block parses, every probe flag exists in its probe, and
README's Python snippets run in order."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks" / "README.md"]
FENCE = re.compile(r"^\s*```(\w*)\n(.*?)^\s*```", re.S | re.M)


def _prose(text: str) -> str:
    """The text outside fenced blocks."""
    return FENCE.sub("", text)


def _blocks(text: str, langs: tuple[str, ...]) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in langs]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()).splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            s = _slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def _files() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(doc):
    text = doc.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(text)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.name}: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(doc):
    """`src/...`, `tests/...`, `benchmarks/...`, `docs/...` as written from the repository root;
    `csrc/...` under src/mha/; `mha/...` under src/."""
    files = _files()
    missing = []
    for span in re.findall(r"`([^`\s]+)`", doc.read_text()):
        path = span.split("::")[0].rstrip(".,:;)/")
        if "<" in path or "*" in path:
            continue
        if re.match(r"(src|tests|benchmarks|docs)/", path):
            full = path
        elif path.startswith("csrc/"):
            full = "src/mha/" + path
        elif re.match(r"mha/\w+(/\w+)*\.py$", path):
            full = "src/" + path
        else:
            continue
        if full not in files:
            missing.append(span)
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_named_tests_exist():
    """A test named in the docs (`test_x`, `test_file.py::test_x`) is defined in tests/."""
    source = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    defined = set(re.findall(r"^\s*(?:async )?(?:def|class) (\w+)", source, re.M))
    missing = []
    for doc in DOCS:
        spans = re.findall(r"`(?:tests/)?(?:\w+\.py::)?(test_\w+)(?:\[[^\]]*\])?`", doc.read_text())
        for name in spans:
            if name not in defined and not (ROOT / "tests" / f"{name}.py").exists():
                missing.append(f"{doc.name}: {name}")
    assert not missing, missing


def _resolves(name: str) -> bool | str:
    """Whether ``mha.a.b`` is a module or an attribute reached from one; the name of a missing
    third-party module when one it imports is not installed."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("mha"):
                return e.name or "?"
    else:
        return False
    for part in parts[i:]:
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def test_named_python_objects_exist():
    """Every dotted `mha.x.y` the docs name imports or is an attribute (a renamed function or
    a moved module shows here)."""
    missing, unchecked = [], []
    for doc in DOCS:
        for name in set(re.findall(r"(?<![\w./])(mha(?:\.\w+)+)", doc.read_text())):
            if name.endswith((".py", ".md", ".json", ".png")):
                continue
            found = _resolves(name)
            if found is False:
                missing.append(f"{doc.name}: {name}")
            elif isinstance(found, str):
                unchecked.append(f"{name} ({found} is not installed)")
    assert not missing, missing
    if unchecked:  # every other name was checked above
        pytest.skip(f"not checked: {', '.join(sorted(unchecked))}")


def _read_variables() -> set[str]:
    """The MHA_* variables the package and the tests read from the environment."""
    found = set()
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.h"),
                 *(ROOT / "src").rglob("*.cpp"), *(ROOT / "tests").glob("*.py")]:
        text = path.read_text()
        found |= set(re.findall(r"(?:environ(?:\.get)?\(|environ\[|getenv\()\s*[\"'](MHA_\w+)",
                                text))
        if "environ" in text:  # a name held in a constant: ENV = "MHA_..."
            found |= set(re.findall(r"^ENV\s*=\s*\"(MHA_\w+)\"", text, re.M))
    return found - {"MHA_TEST_CXX_LOG"}  # a test's own wrapper compiler log, set and read there


def test_environment_table_lists_every_variable_read():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(MHA_\w+)`", table, re.M))
    read = _read_variables()
    assert {"MHA_BUILD_DIR", "MHA_FLASH_BF16"} <= read  # the scan finds what it should
    assert read - listed == set(), "read by the code, missing from README's table"
    assert listed - read == set(), "in README's table, read by nothing"


def _commands(text: str) -> list[str]:
    """`mha ...` command lines of the fenced shell blocks, comments and pipes removed."""
    out = []
    for body in _blocks(text, ("bash", "sh", "")):
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            for part in re.split(r"&&|;|\|", line.split(" #")[0]):
                m = re.match(r"(?:env (?:-u \w+ )*)?(?:\.venv/bin/)?mha (.*)", part.strip())
                if m and "/path/to/" not in part:
                    out.append(m.group(1))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_mha_commands_parse(doc, monkeypatch):
    from mha.cli import build_parser

    monkeypatch.chdir(ROOT)  # paths such as benchmarks/results/... are the repository's
    parser = build_parser()
    for command in _commands(doc.read_text()):
        # [--x] is an option shown as optional, "..." more of the same
        args = shlex.split(re.sub(r"\[([^\]]*)\]", r"\1", command).replace("...", ""))
        parsed = parser.parse_args(args)  # a usage error raises, naming the option
        check = getattr(importlib.import_module(f"mha.cli.{parsed.command}"), "check", None)
        if check is not None:  # what the command refuses before any work: suites, tasks, ...
            check(parsed)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_probe_flags_exist(doc):
    """Every `--flag` shown after `<probe>.py` is an option of that probe (or of _timing.py)."""
    probes = ROOT / "benchmarks" / "probes"
    shared = (probes / "_timing.py").read_text()
    unknown = []
    for line in re.sub(r"\\\n\s*", " ", doc.read_text()).splitlines():
        for name, rest in re.findall(r"(\w+)\.py((?: [^`|#]*)?)", line):
            if not (probes / f"{name}.py").exists():
                continue
            source = (probes / f"{name}.py").read_text() + shared
            unknown += [f"{name}.py {flag}" for flag in re.findall(r"(?<![\w-])(--[\w-]+)", rest)
                        if f'"{flag}"' not in source]
    assert not unknown, f"{doc.name}: {unknown}"


# Names README's snippets leave to the reader, given values of the shapes their comments state.
README_GIVEN = {
    "memory": lambda: torch.randn(32, 11, 512),        # cross-attention input, Tk != Tq
    "s": lambda: torch.randn(8),                       # sinks (h,)
    "position_bias": lambda: torch.randn(1, 8, 5, 9),  # (1, h, Tq, Tk)
    "b": lambda: torch.randn(1, 8, 20, 20),            # the module's per-call bias
}


def test_readme_python_snippets_run_in_order(tmp_path, monkeypatch):
    """The torch-only snippets, one namespace as a reader runs them; the block-plan snippet
    gets q, k, v of its documents' length (1024) and prefix_lm's batch (2)."""
    monkeypatch.chdir(tmp_path)  # the snippets write attn.safetensors
    torch.manual_seed(0)
    ns = {name: make() for name, make in README_GIVEN.items()}
    ran = 0
    for body in _blocks((ROOT / "README.md").read_text(), ("python",)):
        if "from_pretrained" in body:
            continue  # needs a model directory: tests/test_hf.py runs that path
        if "block_plan" in body:
            ns.update(q=torch.randn(2, 8, 1024, 64), k=torch.randn(2, 8, 1024, 64),
                      v=torch.randn(2, 8, 1024, 64))
        exec(compile(body, "README.md", "exec"), ns)  # noqa: S102 - the README's own code
        ran += 1
    assert ran >= 5


# Other pages' snippets: before a block containing the marker, the names it leaves to the
# reader (a function of the namespace so far). Pages whose snippets need a model file, a
# process group or minutes (llm, huggingface, distributed, export, viz's MiniLM maps) are run
# by their own tests.
GIVEN = {
    "docs/decoding.md": [
        ("prompt (4, T0, 512)", lambda ns: dict(prompt=torch.randn(4, 6, 512),
                                                x_next=torch.randn(4, 1, 512))),
        ("x_draft", lambda ns: dict(x_draft=torch.randn(4, 3, 512), n_accepted=2)),
        ("best_beams", lambda ns: dict(best_beams=torch.tensor([1, 1, 0, 3]))),
        ("padded_prompts", lambda ns: dict(
            cache=ns["attn"].new_cache(batch_size=4, max_len=64), T_pad=7,
            padded_prompts=torch.randn(4, 7, 512), left_padded_prompts=torch.randn(4, 7, 512),
            prompt_lengths=torch.tensor([7, 5, 3, 6]))),
        ('kv_dtype="int8")', lambda ns: dict(
            B=2, h_kv=2, T_max=32, d=64, k_new=torch.randn(2, 2, 3, 64),
            v_new=torch.randn(2, 2, 3, 64), q=torch.randn(2, 8, 1, 64))),
        ("PagedKVCache", lambda ns: dict(n=5, layer=0, k=torch.randn(5, 3, 64),
                                         v=torch.randn(5, 3, 64), q=torch.randn(1, 9, 1, 64))),
    ],
    "docs/module.md": [
        ("softcap=50.0", lambda ns: dict(x=torch.randn(2, 16, 512),
                                         t5_bias=torch.randn(1, 8, 16, 16))),
        ("rope=True", lambda ns: {}),
    ],
    "docs/viz.md": [("mha.trace", lambda ns: {})],
    "docs/kernel.md": [("flash.flash_attention", lambda ns: dict(
        q=torch.randn(1, 8, 40, 64), k=torch.randn(1, 2, 40, 64), v=torch.randn(1, 2, 40, 32)))],
}


@pytest.mark.parametrize("page", sorted(GIVEN))
def test_page_python_snippets_run_in_order(page, tmp_path, monkeypatch):
    """The listed snippets of a page, in order, in one namespace, as a reader runs them."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    ns: dict = {"torch": torch, "mha": importlib.import_module("mha")}
    ran = 0
    for body in _blocks((ROOT / page).read_text(), ("python",)):
        given = [make for marker, make in GIVEN[page] if marker in body]
        if not given:
            continue
        for make in given:
            ns.update(make(ns))
        exec(compile(body, page, "exec"), ns)  # noqa: S102 - the page's own code
        ran += 1
    assert ran == len(GIVEN[page])  # every listed snippet is still there and ran
