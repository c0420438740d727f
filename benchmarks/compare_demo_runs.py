"""Compare the video figures of two `fp4vis demo` runs (e.g. two machines): per policy and figure, both means,
their difference, and whether each mean lies inside the other run's 95 % interval; per clip, how many
readings differ. Exit status 1 when a mean falls outside the other run's interval.

    python benchmarks/compare_demo_runs.py out/demo/demo.json other/demo/demo.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def figures(run: dict) -> dict[tuple[str, str], dict]:
    """(policy, figure) -> {mean, ci95_low, ci95_high} (a rate as its mean) for every interval of the video."""
    out = {}
    for policy, s in run["video"]["policies"].items():
        for k, ci in (s.get("latent_cosine_after") or {}).items():
            out[(policy, f"cos @{k}")] = ci
        for name in ("psnr_db", "ssim"):
            if name in s:
                out[(policy, name)] = s[name]
        for name in ("digit_read", "direction_read"):
            out[(policy, name)] = {"mean": s[name]["rate"], "ci95_low": s[name]["ci95_low"],
                                   "ci95_high": s[name]["ci95_high"]}
    for policy, d in (run["video"].get("paired") or {}).items():
        for name, ci in d.items():
            out[(f"{policy} - {run['video']['paired_with']}", name)] = ci
    return out


def inside(x: float, ci: dict) -> bool:
    return ci["ci95_low"] is not None and ci["ci95_low"] - 1e-12 <= x <= ci["ci95_high"] + 1e-12


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path, help="demo.json of the first run")
    p.add_argument("b", type=Path, help="demo.json of the second run")
    args = p.parse_args(argv)
    ra, rb = (json.loads(f.read_text()) for f in (args.a, args.b))
    va, vb = ra["video"], rb["video"]
    if (va["prompts"], va["seeds"], va["dtype"]) != (vb["prompts"], vb["seeds"], vb["dtype"]):
        print("the runs differ in prompts, seeds or dtype: nothing to compare", file=sys.stderr)
        return 2
    for r, f in ((ra, args.a), (rb, args.b)):
        env, cpu = r.get("environment", {}), r["video"].get("cpu", {})
        print(f"{f}: {cpu.get('model')} ({cpu.get('capability')}, {cpu.get('threads')} threads), torch "
              f"{env.get('versions', {}).get('torch')}, Python {env.get('python')}")
    fa, fb = figures(ra), figures(rb)
    bad = 0
    print(f"{'policy':<18} {'figure':<15} {'run a':>10} {'run b':>10} {'b - a':>10}  a in b's CI  b in a's CI")
    for key in fa:
        if key not in fb or fa[key].get("mean") is None:
            continue
        a, b = fa[key]["mean"], fb[key]["mean"]
        ok_a, ok_b = inside(a, fb[key]), inside(b, fa[key])
        bad += not (ok_a and ok_b)
        print(f"{key[0]:<18} {key[1]:<15} {a:>10.5f} {b:>10.5f} {b - a:>+10.5f}  {str(ok_a):<11}  {ok_b}")
    reads = [(c["prompt"], p) for ca, c in zip(va["per_clip"], vb["per_clip"]) for p in c["policies"]
             if (ca["policies"][p]["read_digit"], ca["policies"][p]["read_direction"])
             != (c["policies"][p]["read_digit"], c["policies"][p]["read_direction"])]
    print(f"readings that differ between the runs: {len(reads)} of {len(va['per_clip']) * len(va['policies'])}"
          + (": " + ", ".join(f"{p} on \"{c}\"" for c, p in reads) if reads else ""))
    print("every mean inside the other run's 95 % interval" if not bad else
          f"{bad} figures outside the other run's interval")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
