r"""Where a kernel's warps wait, per part of the kernel: Nsight Compute's source counters (warp stall samples per SASS
instruction) summed over the instructions that run equally often, which in the Hopper kernel separates its parts:
the consumer's key loop (once per warp and key tile), its prologue, peeled tiles and epilogue (once per warp and
CTA), and the producer's loop.

    ncu --clock-control none -k regex:DirectP --launch-skip 1 --launch-count 1 --section SourceCounters \
        --import-source no -f -o prof python benchmarks/ncu_kernel.py --shape 1,8192,24 --policy fp8
    ncu -i prof.ncu-rep --page source --csv --print-source sass > src.csv
    python benchmarks/ncu_source.py src.csv [--top 20] [--span dbd30-dd1f0] > summary.txt

``--span`` adds the samples of one address range (the low 20 bits of the addresses, in hex, as the listing prints
them), e.g. the epilogue's, which shares its execution count with the prologue and the peeled tiles.
"""

from __future__ import annotations

import argparse
import collections
import csv
import lzma

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_rows(path: str) -> list[dict]:
    """The CSV's instruction rows (a .xz file is read as compressed)."""
    with (lzma.open(path, "rt") if path.endswith(".xz") else open(path, newline="")) as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names = rows[head]
    return [dict(zip(names, r)) for r in rows[head + 1:] if len(r) == len(names)]


def number(row: dict, name: str) -> int:
    try:
        return int(float(row.get(name) or 0))
    except ValueError:
        return 0


def low_address(row: dict) -> int:
    return int(row["Address"], 16) & 0xFFFFF


def summary(rows: list[dict], top: int, spans: list[str] = ()) -> str:
    stalls = [n for n in rows[0] if n.startswith("stall_") and "Not Issued" not in n]
    total = sum(number(r, SAMPLES) for r in rows)
    groups = collections.defaultdict(list)
    for r in rows:
        groups[number(r, EXECUTED)].append(r)
    out = [f"{len(rows)} SASS instructions, {total} warp stall samples", "",
           "instructions executed equally often (a part of the kernel): instructions, share of the samples, "
           "stall reasons by share of the part's samples"]
    for executed, part in sorted(groups.items(), key=lambda g: -sum(number(r, SAMPLES) for r in g[1])):
        samples = sum(number(r, SAMPLES) for r in part)
        if samples < 0.005 * total:
            continue
        reasons = collections.Counter({s[len("stall_"):]: sum(number(r, s) for r in part) for s in stalls})
        spread = ", ".join(f"{k} {v / samples:.0%}" for k, v in reasons.most_common(8) if v)
        mnemonics = collections.Counter(r["Source"].split()[0 if not r["Source"].startswith("@") else 1]
                                        .split(".")[0] for r in part)
        out.append(f"- executed {executed}: {len(part)} instructions, {samples / total:.1%} of the samples; {spread}")
        out.append("  mnemonics: " + ", ".join(f"{k} {v}" for k, v in mnemonics.most_common(12)))
    for span in spans:
        lo, hi = (int(x, 16) for x in span.split("-"))
        inside = [r for r in rows if lo <= low_address(r) <= hi]
        samples = sum(number(r, SAMPLES) for r in inside)
        out.append(f"- span {span}: {len(inside)} instructions, {samples / total:.1%} of the samples")
    out += ["", f"the {top} instructions with the most samples (address, executed, samples, top reasons, SASS)"]
    for r in sorted(rows, key=lambda r: -number(r, SAMPLES))[:top]:
        reasons = sorted(((number(r, s), s[len("stall_"):]) for s in stalls), reverse=True)[:2]
        why = ", ".join(f"{n} {v}" for v, n in reasons if v)
        out.append(f"- {low_address(r):05x} {number(r, EXECUTED)} {number(r, SAMPLES)} ({why}) {r['Source'].strip()}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.xz)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--span", action="append", default=[], metavar="LO-HI",
                    help="also the share of the samples in this address range (low 20 bits, hex); repeatable")
    a = ap.parse_args(argv)
    print(summary(read_rows(a.csv), a.top, a.span))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
