"""The tuner's ``compile`` setting: the "auto" decision (pure numbers), the accepted values, the
config key and CLI flag, and real ``hydro.tune`` runs compiled (refills reuse the compiled
graph) and on "auto" (decided and said once per key)."""

from __future__ import annotations

import optuna
import pytest
import torch
from optuna.distributions import FloatDistribution

import hydro
import hydro.tuning.stream as stream_module
from hydro.cli import main
from hydro.errors import ConfigError
from hydro.tuning import compiling
from hydro.tuning.config import load
from tests import toy

optuna.logging.set_verbosity(optuna.logging.WARNING)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_decide_compiles_only_where_it_pays_back_twice() -> None:
    # saves 0.74 * (1 - 1/1.5) = 0.2467 s a step: 400 steps save 98.7 s > 2 x 45 s
    on, line = compiling.decide(0.74, 400, 45.0, speedup=1.5)
    assert on
    assert line == ("compile: auto -> on (eager step 0.74 s x ~400 fused steps left = 296 s; "
                    "compile est. 45 s, pays back after ~183 steps)")
    # 300 steps save 74 s < 90 s: off, though it would pay back once (after 183 steps)
    on, line = compiling.decide(0.74, 300, 45.0, speedup=1.5)
    assert not on and line.startswith("compile: auto -> off (eager step 0.74 s x ~300")
    # exactly twice the compile time is not enough
    assert not compiling.decide(1.0, 60, 15.0, speedup=2.0)[0]  # saves 30 s: = 2 x 15
    assert compiling.decide(1.0, 61, 15.0, speedup=2.0)[0]
    # no speed-up: never, whatever the budget
    on, line = compiling.decide(1.0, 1e9, 1.0, speedup=1.0)
    assert not on and "pays back after ~inf steps" in line


def test_compile_estimate_grows_with_the_graph() -> None:
    small, large = compiling.estimate_compile_seconds(14), compiling.estimate_compile_seconds(175)
    assert compiling.COMPILE_BASE_S < small < large


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), ("on", True), ("OFF", False), ("auto", "auto"),
     ("max-autotune", "max-autotune")],
)
def test_check_compile_accepts(value: object, expected: object) -> None:
    assert compiling.check_compile(value) == expected


@pytest.mark.parametrize("value", ["fast", 3, None, {"mode": "default"}])
def test_check_compile_refuses(value: object) -> None:
    with pytest.raises(ConfigError, match=r"compile must be True/'on', False/'off', 'auto'"):
        compiling.check_compile(value)


def toy_task(steps: int = 8) -> hydro.Task:
    return toy.task(steps=steps, eval_every=4)


SPACE = {"lr": FloatDistribution(1e-3, 1e-1, log=True)}


def test_tune_compiled_reuses_the_graph_across_refills(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 trials in slots of 2: the slots are refilled with no compilation; each mode compiled
    once."""
    groups = []
    start = stream_module.start_group

    def recording(*args, **kwargs):
        source = start(*args, **kwargs)
        groups.append(source.group)
        return source

    monkeypatch.setattr(stream_module, "start_group", recording)
    result = hydro.tune(toy_task(), SPACE, n_trials=4, ratio=2, fuse=2, compile=True,
                        storage="sqlite:///:memory:", seed=0,
                        pruner=optuna.pruners.NopPruner())
    trials = result.study.trials
    assert len(trials) == 4 and all(t.state.name == "COMPLETE" for t in trials)
    assert len(groups) == 1 and {t.user_attrs["group"] for t in trials} == {0}  # refilled
    group = groups[0]
    compiler = group.compiled_graphs or group.fused._compiler
    assert compiler is not None and compiler.failed is None and group.compile is True
    # the training step as one graph and the eval graph, at size 2, each compiled once:
    # nothing recompiled at a refill
    assert len(compiler._steps) == len(compiler._cache) == 1
    assert compiler.stats["compiles"] == 2
    assert {metas[0][0][0] for _, metas in compiler._cache} == {2}
    assert {key[-1][0][0][0] for key in compiler._steps} == {2}  # its first input: a parameter


def test_tune_auto_decides_once_per_key_and_says_so() -> None:
    result = hydro.tune(toy_task(), SPACE, n_trials=2, ratio=2, fuse=2, compile="auto",
                        storage="sqlite:///:memory:", seed=0)
    lines = result.study.user_attrs["hydro_compile"]
    assert len(lines) == 1
    # a few fused steps of milliseconds never pay for a compile of tens of seconds
    assert lines[0].startswith("compile: auto -> off (eager step ") and "pays back" in lines[0]


def config(value: str) -> str:
    return toy.config("toymod", top=f"compile: {value}\n", batch_size=None, lr_low="1.0e-4")


@pytest.fixture
def project(tmp_path, monkeypatch):
    return toy.project(tmp_path, monkeypatch, "toymod", toy.source(n=128, n_train=96, width=32))


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), ("on", True), ("off", False),
                                                 ("max-autotune", "max-autotune")])
def test_config_key(project, value: str, expected: object) -> None:
    (project / "tune.yaml").write_text(config(value))
    assert load("tune.yaml").compile == expected
    assert load("tune.yaml", compile="off").compile is False  # the flag wins


def test_config_key_refuses_bad_values(project) -> None:
    (project / "tune.yaml").write_text(config("sometimes"))
    with pytest.raises(ConfigError, match=r"tune.yaml: compile must be True/'on'"):
        load("tune.yaml")


def test_cli_flag(project, capsys) -> None:
    (project / "tune.yaml").write_text(config("on"))
    assert main(["tune", "tune.yaml", "--compile", "auto", "--no-progress"]) == 0
    study = optuna.load_study(study_name="toy", storage="sqlite:///toy.db")
    assert study.user_attrs["hydro_compile"][0].startswith("compile: auto -> off")
    # without a progress display the decision still reaches the terminal
    assert "compile: auto -> off (eager step" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "tune.yaml", "--compile", "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


def test_a_keys_later_group_reuses_the_compiled_graph() -> None:
    """A second group of one key (built ``like`` the first) runs the first's compiled graph."""
    from hydro.tuning.group import FusedGroup

    task = toy_task()
    members = [(k, {"lr": 1e-2 * (k + 1)}, k) for k in range(2)]
    first = FusedGroup(task, members, ratio=2, compile=True)
    first.step()
    compiles = first.fused.compile_stats["compiles"]
    assert compiles == 1
    second = FusedGroup(task, [(k + 2, p, s + 2) for k, p, s in members], ratio=2,
                        compile=True, like=first)
    second.step()
    second.step()
    assert second.fused._compiler is first.fused._compiler  # one count for the key
    assert second.fused.compile_stats["compiles"] == compiles  # nothing compiled again
    assert torch.isfinite(second.step()).all()


def test_no_compiler_means_eager_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch.compile cannot run (here: the check reports no C++ compiler), a group asked
    to compile trains eagerly and says why."""
    from hydro.tuning.group import FusedGroup

    why = "torch.compile cannot run here (CalledProcessError: no C++ compiler)"
    monkeypatch.setattr(compiling, "unavailable", lambda: why)
    said: list[str] = []
    group = FusedGroup(toy_task(), [(0, {"lr": 1e-2}, 0)], ratio=2, compile=True, note=said.append)
    group.step()
    assert said == [f"compile: True -> off ({why})"]
    assert group.compile is False and group.fused._compiler is None
    # "auto" checks only once it would compile (the check itself compiles: seconds, cold)
    monkeypatch.setattr(compiling, "decide", lambda *a, **k: (True, "compile: auto -> on (...)"))
    said.clear()
    group = FusedGroup(toy_task(), [(0, {"lr": 1e-2}, 0)], ratio=2, compile="auto",
                       note=said.append)
    for _ in range(compiling.MEASURED_STEPS + 1):
        group.step()
    assert said == [f"compile: auto -> off ({why})"]
    assert group.compile is False and group.fused._compiler is None


def test_executor_workers_take_the_setting() -> None:
    """``compile`` reaches a local executor's worker: with it on, the study completes with the
    values of the eager in-process run (float32; inductor may reorder sums). (That the worker
    compiled is not observable from here: its groups' counts stay in its process.)"""
    from hydro.integrations.optuna import optimize
    from hydro_fluid import LocalExecutor

    values = {}
    for compile, executor in ((True, LocalExecutor(devices=[], num_workers=1)), (False, None)):
        study = optuna.create_study(pruner=optuna.pruners.NopPruner(),
                                    sampler=optuna.samplers.RandomSampler(seed=0))
        optimize(study, toy_task(), SPACE, n_trials=2, ratio=2, fuse=2, seed=0,
                 executor=executor, compile=compile)
        assert all(t.state.name == "COMPLETE" for t in study.trials)
        values[compile] = [t.value for t in study.trials]
    assert values[True] == pytest.approx(values[False], rel=1e-4)


def test_a_resized_group_goes_eager_and_keeps_its_graphs() -> None:
    """A compiled group that shrinks (a freed slot no trial refills) trains eagerly from then
    on rather than compile the new size; the key's next group still reuses its graphs."""
    from hydro.tuning.group import FusedGroup

    task = toy_task()
    group = FusedGroup(task, [(k, {"lr": 1e-2}, k) for k in range(2)], ratio=2, compile=True)
    group.step()
    compiler = group.fused._compiler
    assert compiler.stats["compiles"] == 1
    group.drop([1])
    assert group.fused._compiler is None and not group.opt.compile
    assert torch.isfinite(group.step()).all()  # eager, size 1
    assert compiler.stats["compiles"] == 1
    later = FusedGroup(task, [(k + 2, {"lr": 1e-2}, k) for k in range(2)], ratio=2,
                       compile=group.compile, like=group)
    later.step()
    assert later.fused._compiler is compiler and compiler.stats["compiles"] == 1
