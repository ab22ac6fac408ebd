"""Every fenced code block of README.md and the user pages of docs/ runs, or says in the markdown
why not. The user pages are docs/**/*.md but the dated measurement logs of docs/evidence/, which
show past runs as they were made.

Rules, block by block (one test per block, so xdist spreads them):

* ``python``: executed in a fresh namespace in a scratch directory. A block that starts worker
  processes (an executor, the real pipeline) runs as a script in a subprocess, where a missing
  ``if __name__ == "__main__":`` fails as it would for the user.
* ``bash`` / ``console`` / ``sh``: every command that starts with ``hydro`` runs through
  :func:`hydro.cli.main` (the ``[...]`` of a synopsis are optional parts and are left out; an
  ``examples/*/tune.yaml`` is replaced by a shrunk copy); installing (``pip``), the test suite,
  cluster commands (``ray start``, ``RAY_ADDRESS=...``) and the long benchmark scripts (which
  must exist) are not run, by rule. Any other command fails the test.
* ``yaml``: a tune config (``task`` and ``space``) is loaded by Hydro's config loader; a
  ``best.yaml`` (``training``) has the keys the training recipe of
  docs/how-to/tune-your-model.md reads.
* no language or ``text``: output shown to the reader, not code.
* Any other language fails: a new kind of block must get a rule here.

Markers, an HTML comment on the line right above the fence (sparingly, with a reason):
``<!-- docs-test: skip (reason) -->``; ``<!-- docs-test: setup NAME -->``, which first runs
``SETUPS[NAME]`` below (the names a fragment assumes, built from the project's examples);
``<!-- docs-test: continue -->``, which runs the page's previous python block first, in the
same namespace (for a shell block: the page's previous shell block that is not skipped, in the
same directory). ``SHRINK`` lists the numbers replaced to keep a block fast.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EVIDENCE = DOCS / "evidence"
USER_PAGES = sorted(p for p in DOCS.rglob("*.md") if EVIDENCE not in p.parents)
PAGES = [ROOT / "README.md", *USER_PAGES]
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(skip|setup|continue)\b\s*(.*?)\s*-->\s*$")
SHELLS = {"bash", "console", "sh", "shell"}
OUTPUT = {"", "text"}


@dataclasses.dataclass
class Block:
    """One fenced block: its page, the line of its opening fence, language, code, marker."""

    page: str
    line: int
    lang: str
    code: str
    marker: tuple[str, str] | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, dedented, with the marker right above each."""
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        assert j < len(lines), f"{page}:{i + 1}: a code block that is never closed"
        above = next((s for s in reversed(lines[:i]) if s.strip()), "")
        mk = MARKER.match(above)
        code = textwrap.dedent("\n".join(lines[i + 1 : j])) + "\n"
        out.append(Block(page, i + 1, m.group(2), code, (mk.group(1), mk.group(2)) if mk else None))
        i = j + 1
    return out


BLOCKS = [b for p in PAGES for b in blocks_of(p)]

# --- setups: what a fragment assumes, from the project's own examples --------------------------

_CHARLM = """
import torch, torch.nn.functional as F
from examples.charlm.data import load
from examples.charlm.model import gpt
torch.manual_seed(0)
_d = load(block_size=16, max_chars=4_000)
(x, y), (xv, yv) = _d["train"], _d["val"]  # 224 and 24 windows of 16 characters
model = gpt(n_layer=2, n_head=4, n_embd=64, block_size=16)
my_model, x_train, y_train, x_val, y_val = model, x, y, xv, yv
"""


def _best_yaml() -> str:
    """The best.yaml that docs/how-to/tune-your-model.md shows."""
    [block] = [b for b in BLOCKS if b.lang == "yaml" and b.code.startswith("hyperparameters:")]
    return block.code


SETUPS = {
    # the charlm GPT of the tutorial, small: the model and data fragments of the how-to pages use
    "charlm": _CHARLM,
    # a Task and a search space over it (docs/how-to/tune-your-model.md's first block, small)
    "charlm-task": _CHARLM
    + """
import optuna, hydro
task = hydro.Task(model=model, train_data=(x, y), val_data=(xv, yv), steps=2,
                  eval_every=2, batch_size=8)
space = {"lr": optuna.distributions.FloatDistribution(1e-4, 3e-2, log=True)}
""",
    # a HuggingFace model with dict batches (docs/how-to/tune-your-model.md, "Dict batches")
    "hf-gpt2": """
import torch, hydro
from examples.hf_gpt2.model import gpt2
torch.manual_seed(0)
model = gpt2(n_layer=1, n_head=2, n_embd=32, block_size=16)
ids = torch.randint(0, model.config.vocab_size, (64, 16))
mask, labels = torch.ones_like(ids), ids.clone()
val = {"input_ids": ids[:16], "attention_mask": mask[:16], "labels": labels[:16]}
""",
    # models to fuse and their batches (docs/explanation/fusion.md): the CNN example on its shapes
    "cnn": """
import torch
from examples.cnn.data import load
from examples.cnn.model import cnn
torch.manual_seed(0)
_x, _y = load(n_train=64, n_val=16, size=16)["train"]
make_model = lambda: cnn(width=8)
loader = [(_x[:32], _y[:32]), (_x[32:], _y[32:])]
""",
    # a pretrained backbone with a fresh head (docs/explanation/fusion.md, "Shared frozen
    # computation")
    "finetune": """
import torch, hydro
from examples.models import ResNet
class FineTune(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = ResNet(width=8)
        self.head = torch.nn.Linear(10, 4)
    def forward(self, x):
        return self.head(self.backbone(x))
torch.manual_seed(0)
pretrained = FineTune().backbone.state_dict()
""",
    # best.yaml as docs/how-to/tune-your-model.md shows it (fewer steps), and the charlm GPT
    # (hydro.recipe's two lines there)
    "recipe": _CHARLM
    + """
import yaml
_best = yaml.safe_load(BEST_YAML)
_best["training"]["steps"] = _best["training"]["warmup"] + 3
with open("best.yaml", "w") as f:
    yaml.safe_dump(_best, f)
build_full_model = lambda: gpt(n_layer=1, n_head=4, n_embd=64, block_size=16)
def next_batch(b):
    i = torch.randint(len(x), (b,))
    return x[i], y[i]
""".replace("BEST_YAML", repr(_best_yaml())),
    # a fused optimizer with a warm-up + cosine schedule (docs/explanation/fusion.md, "Refilling a
    # slot")
    "reset": """
import torch, hydro
from hydro.optim import lr_scheduler as ls
fused = hydro.fuse(torch.nn.Linear(4, 3), n=2)
opt = hydro.optim.AdamW(fused.parameters(), lr=[1e-3, 2e-3])
sched = ls.SequentialLR(opt, [ls.LinearLR(opt, start_factor=0.1, total_iters=10),
                              ls.CosineAnnealingLR(opt, T_max=90)], milestones=[10])
""",
}

# numbers too slow for a test, replaced (each must still be in one of its page's blocks)
SHRINK = {
    "README.md": [("n_trials=32", "n_trials=2"), ("steps=100", "steps=2"),
                  ("eval_every=20", "eval_every=2"), ("fuse=16", "fuse=2")],
    "docs/tutorial.md": [("n_layer=4, n_head=4, n_embd=256, block_size=64",
                          "n_layer=1, n_head=4, n_embd=64, block_size=16"),
                         ("load(block_size=64)", "load(block_size=16, max_chars=4_000)"),
                         ("steps=200", "steps=2"), ("eval_every=50", "eval_every=2"),
                         ("batch_size=32", "batch_size=8"), ("n_trials=32", "n_trials=2, fuse=2")],
    "docs/how-to/tune-your-model.md": [("n_trials=64", "n_trials=2"), ("steps=300", "steps=2"),
                                       ("eval_every=50", "eval_every=2"), ("fuse=16", "fuse=2"),
                                       ("IntDistribution(0, 50)", "IntDistribution(0, 1)")],
    "docs/reference/cli.md": [("gpt -o coord.png", "gpt --ratios 1,8 --steps 2 -o coord.png"),
                              ("--parametrization sp", "--ratios 1,8 --parametrization sp")],
    "docs/reference/models.md": [("num_hidden_layers=4", "num_hidden_layers=1")],
    "docs/how-to/pipeline-bubbles.md": [("steps=6, micro_batches=4", "steps=2, micro_batches=2"),
                                        ("width=1024, batch=128", "width=128, batch=16")],
    "docs/reference/examples.md": [("n_layer=4, n_head=4, n_embd=256",
                                    "n_layer=1, n_head=4, n_embd=64")],
}


def _shrunk(block: Block) -> str:
    code = block.code
    for old, new in SHRINK.get(block.page, []):
        code = code.replace(old, new)
    return code


def _chain(block: Block) -> list[Block]:
    """The blocks this block runs after (``continue``), then the block itself: the page's
    python blocks before it, or for a shell block the shell blocks before it that run."""
    kinds = SHELLS if block.lang in SHELLS else {block.lang}
    page = [b for b in BLOCKS if b.page == block.page and b.lang in kinds]
    same = [b for b in page if b.line < block.line]
    if block.lang in SHELLS:
        same = [b for b in same if not (b.marker and b.marker[0] == "skip")]
    if block.marker and block.marker[0] == "continue":
        assert same, f"{block.id}: 'continue' with no {block.lang} block before it on the page"
        return [*_chain(same[-1]), block]
    return [block]


def _setup(block: Block) -> str:
    first = _chain(block)[0]
    if first.marker and first.marker[0] == "setup":
        assert first.marker[1] in SETUPS, f"{first.id}: no setup named {first.marker[1]!r}"
        return SETUPS[first.marker[1]]
    return ""


def _spawns(code: str) -> bool:
    """Whether the code starts worker processes: then it runs as a script."""
    return bool(re.search(r"\bLocalExecutor\(|\bRayExecutor\(|\brun_pipeline\(", code))


def _skip_reason(block: Block) -> None:
    _, arg = block.marker
    assert re.fullmatch(r"\(.{8,}\)", arg), f"{block.id}: a skip needs its reason: skip (why)"


def _run_python(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = _setup(block) + "\n".join(_shrunk(b) for b in _chain(block))
    monkeypatch.chdir(tmp_path)
    if _spawns(code):
        script = tmp_path / "snippet.py"
        script.write_text(code)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{block.id} failed as a script:\n{proc.stderr[-3000:]}"
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exec(compile(code, f"{block.id}", "exec"), {"__name__": "__main__"})
    finally:
        torch.set_num_threads(threads)


# --- shell blocks --------------------------------------------------------------------------------

NOT_RUN = [  # (pattern, why): commands the test never runs
    (r"(python3? -m )?pip install\b", "installs packages"),
    (r"python3? -m pytest\b", "the test suite itself"),
    (r"ray start\b", "starts a Ray cluster"),
    (r"RAY_ADDRESS=\S+ ", "needs a Ray cluster"),
]
BENCHMARK = re.compile(r"^(nice )?python3? (benchmarks/\S+\.py)\b")
TINY_CONFIG = {  # the examples' tune.yaml files, shrunk: the same model and data, tiny
    "trials": 2, "fuse": 2,
    "task": {"steps": 3, "eval_every": 3, "batch_size": 8},
    "model_args": {
        "examples.charlm.model:gpt": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
        "examples.hf_gpt2.model:gpt2": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
        "examples.cnn.model:cnn": {"width": 16},
    },
    "data_args": {
        "examples.charlm.data:load": {"block_size": 16, "max_chars": 20_000},
        "examples.hf_gpt2.data:load": {"block_size": 16, "max_chars": 20_000},
        "examples.own_loop.data:load": {"block_size": 16, "max_chars": 20_000},
        "examples.cnn.data:load": {"n_train": 64, "n_val": 32, "size": 16, "seed": 0},
    },
}


def commands(code: str) -> list[str]:
    """The commands of a shell block: comments dropped, continuation lines joined."""
    out: list[str] = []
    for raw in code.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if line.startswith("$ "):
            line = line[2:]
        if not line.strip():
            continue
        if out and (raw[:1].isspace() or out[-1].endswith("\\")):
            out[-1] = out[-1].rstrip("\\").rstrip() + " " + line.strip()
        else:
            out.append(line.strip())
    return out


def _tiny_config(src: Path, dst: Path) -> None:
    cfg = yaml.safe_load(src.read_text())
    cfg.update(trials=TINY_CONFIG["trials"], fuse=TINY_CONFIG["fuse"])
    task = cfg["task"]
    task.update(TINY_CONFIG["task"])
    task["model_args"] = {**task.get("model_args", {}), **TINY_CONFIG["model_args"][task["model"]]}
    task["data_args"] = {**task.get("data_args", {}), **TINY_CONFIG["data_args"][task["data"]]}
    if "warmup" in cfg.get("space", {}):  # a warm-up must stay shorter than the tiny run
        cfg["space"]["warmup"].update(low=0, high=1)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(yaml.safe_dump(cfg))


def _run_hydro(command: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from hydro.cli import main

    argv = shlex.split(re.sub(r"\s*\[[^\[\]]*(\[[^\[\]]*\][^\[\]]*)*\]", "", command))[1:]
    for arg in argv:
        if arg.startswith("examples/") and arg.endswith("tune.yaml"):
            _tiny_config(ROOT / arg, tmp_path / arg)  # the same relative path, in the scratch dir
    # coord-check exits 1 on a FAIL verdict, which the docs show on purpose for the naive sp
    expected = 1 if argv[0] == "coord-check" and "sp" in argv else 0
    code = main(argv)
    err = capsys.readouterr().err
    assert code == expected, f"`{command}` exited {code}:\n{err}"


def _run_shell(block: Block, tmp_path: Path, monkeypatch, capsys) -> None:
    import torch

    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for command in [c for b in _chain(block) for c in commands(_shrunk(b))]:
            for part in re.split(r"\s*&&\s*", command):
                if part.startswith("hydro "):
                    _run_hydro(part, tmp_path, capsys)
                elif m := BENCHMARK.match(part):  # minutes long: the script must exist
                    assert (ROOT / m.group(2)).is_file(), f"{block.id}: no script {m.group(2)}"
                elif not any(re.match(p, part) for p, _ in NOT_RUN):
                    pytest.fail(f"{block.id}: `{part}` neither runs nor is skipped by rule: "
                                "add a rule here or a docs-test marker")
    finally:
        torch.set_num_threads(threads)


# --- yaml blocks ---------------------------------------------------------------------------------

RECIPE_KEYS = {"optimizer", "optimizer_args", "scheduler", "warmup", "steps", "batch_size",
               "grad_clip"}


def _check_yaml(block: Block, tmp_path: Path) -> None:
    data = yaml.safe_load(block.code)
    if "training" in data:
        assert RECIPE_KEYS <= set(data["training"]), f"{block.id}: training lacks recipe keys"
        assert {"hyperparameters", "training", "provenance"} <= set(data), block.id
        return
    assert {"task", "space"} <= set(data), f"{block.id}: neither a tune config nor a best.yaml"
    from hydro.tuning import config

    path = tmp_path / "tune.yaml"
    path.write_text(block.code)
    config.load(str(path))


# --- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block: Block, tmp_path, monkeypatch, capsys):
    if block.marker and block.marker[0] == "skip":
        _skip_reason(block)
        return
    if block.lang in OUTPUT:
        assert block.marker is None, f"{block.id}: output blocks are never run: no marker"
        return
    if re.search(r"\btransformers\b|hf_gpt2", block.code + _setup(block)):
        pytest.importorskip("transformers")  # the hf extra
    if block.lang == "python":
        _run_python(block, tmp_path, monkeypatch)
    elif block.lang in SHELLS:
        _run_shell(block, tmp_path, monkeypatch, capsys)
    elif block.lang == "yaml":
        _check_yaml(block, tmp_path)
    else:
        pytest.fail(f"{block.id}: no rule runs ```{block.lang} blocks: add one or mark it")


def test_shrink_and_setups_are_all_used():
    """A stale entry would silently stop shrinking: each must still match its page."""
    for page, pairs in SHRINK.items():
        code = "".join(b.code for b in BLOCKS if b.page == page)
        for old, _ in pairs:
            assert old in code, f"SHRINK[{page!r}]: {old!r} is no longer on the page"
    used = {b.marker[1] for b in BLOCKS if b.marker and b.marker[0] == "setup"}
    assert used == set(SETUPS), f"unused: {set(SETUPS) - used}, missing: {used - set(SETUPS)}"


def test_every_page_is_in_the_site_nav():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def files(entries) -> list[str]:
        out = []
        for e in entries:
            v = next(iter(e.values())) if isinstance(e, dict) else e
            out += files(v) if isinstance(v, list) else [v]
        return out

    listed = files(nav)
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(listed) == pages, f"nav {sorted(listed)} != docs/ {pages}"
    assert listed[0] == "index.md", "the site opens at docs/index.md: list it first"


def test_the_front_page_links_to_every_user_page():
    text = (DOCS / "index.md").read_text()
    links = set(re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", text))
    users = {p.relative_to(DOCS).as_posix() for p in PAGES if p.is_relative_to(DOCS)}
    assert users - {"index.md"} <= links, f"not on the front page: {users - links - {'index.md'}}"
    missing = [link for link in links if not (DOCS / link).is_file()]
    assert not missing, f"docs/index.md links to missing pages: {missing}"


def test_the_options_page_is_the_code_table():
    """Each default is stated once, in the options reference, generated from TuneOptions."""
    from hydro.tuning.options import TuneOptions

    page = (DOCS / "reference" / "options.md").read_text()
    found = re.search(r"<!-- options-table:[^\n]*-->\n(.*?)\n<!-- /options-table -->", page, re.S)
    assert found, "docs/reference/options.md lost its generated table"
    assert found.group(1) == TuneOptions.table(), "regenerate the table: TuneOptions.table()"
