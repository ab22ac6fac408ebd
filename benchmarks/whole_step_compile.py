"""Where the whole-step graph's compile (hydro.fusion.step.train_step) spends its time, cold
and warm: each model's first step in two fresh processes sharing a fresh
``TORCHINDUCTOR_CACHE_DIR`` (cold, then warm), split into the ``make_fx`` trace and inductor's
``compile_fx``, with inductor's FX graph cache and AOTAutograd's cache counters.

``--direct`` also runs, side by side, the call hydro made before (``compile_fx`` on the real
tensors: no ShapeEnv, so both caches bypass the graph). One torch thread.

    python benchmarks/whole_step_compile.py [--models "MLP w64" "GPT charlm r8"] [--direct]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))


def child(which: str, direct: bool) -> dict:
    """One process: build the model's fused step, run two steps, time the first's parts."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, HERE)
    import fusion as bench
    from torch._dynamo.utils import counters

    import hydro.fusion.step as step_module

    spent = {"compile_fx": 0.0}
    backend = step_module._backend
    if direct:

        def backend(options):  # the call before the ShapeEnv fix
            from torch._inductor.compile_fx import compile_fx

            config = torch._TorchCompileInductorWrapper(None, None, None).config
            return lambda g, example: compile_fx(g, example, config_patches=config)

    def timed(options):
        inner = backend(options)

        def compile(graph, example):
            start = time.perf_counter()
            out = inner(graph, example)
            spent["compile_fx"] += time.perf_counter() - start
            return out

        return compile

    step_module._backend = timed
    make, n = bench.COMPILED[which]
    step, fused = bench.compiled_pair(make, n, True, whole=True)
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    seconds = fused._compiler.stats["seconds"]
    return {
        "first": first,
        "trace": seconds - spent["compile_fx"],
        "compile_fx": spent["compile_fx"],
        "fxgraph": {
            k[len("fxgraph_cache_") :]: v
            for k, v in counters["inductor"].items()
            if k.startswith("fxgraph_cache_")
        },
        "aot": {
            k[len("autograd_cache_") :]: v
            for k, v in counters["aot_autograd"].items()
            if k.startswith("autograd_cache_")
        },
    }


def pair(which: str, direct: bool) -> list[dict]:
    """Cold then warm, in fresh processes sharing one fresh inductor cache folder."""
    cache = tempfile.mkdtemp(prefix="hydro-whole-step-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    rows = []
    for _ in ("cold", "warm"):
        args = [sys.executable, __file__, "--child", which] + (["--direct"] if direct else [])
        done = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["MLP w64", "GPT charlm r8"])
    parser.add_argument("--direct", action="store_true", help="also the direct compile_fx call")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.direct)))
        return
    print(f"load: {os.getloadavg()}")
    print(
        "| model | compile | first step s | trace s | compile_fx s | FX graph cache | AOT cache |"
    )
    print("|---|---|---|---|---|---|---|")
    for which in args.models:
        ways = [False, True] if args.direct else [False]
        with ThreadPoolExecutor(len(ways)) as pool:  # before and after side by side
            results = list(pool.map(functools.partial(pair, which), ways))
        for direct, rows in zip(ways, results):
            for label, r in zip(("cold", "warm"), rows):
                how = f"{label}, {'direct' if direct else 'ShapeEnv'}"
                print(f"| {which} | {how} | {r['first']:.1f} | {r['trace']:.1f} | "
                      f"{r['compile_fx']:.1f} | {r['fxgraph']} | {r['aot']} |")
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
