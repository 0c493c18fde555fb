"""LagKV's tilings (``kernels.lagkv.TILINGS``) side by side, from ``benchmarks.kernel_stats`` result files (compiled,
no GPU): per tiling, Triton version and arch, the resources and what one partition costs a program.

    python -m benchmarks.kernel_stats --only lagkv "lagkv[tile=16,warps=4]" ... --out DIR   # per Triton version
    python -m benchmarks.lagkv_tilings DIR/kernel_stats-triton-*.json > benchmarks/results/lagkv_tilings.md
    python -m benchmarks.lagkv_tilings --layouts     # per Triton version (PYTHONPATH): the channel layouts

Per partition: the SASS instructions of the partition loop's body (its own, plus the loops inside it × their
iterations per partition), per warp and × the warps (warp-instructions: the SM's issue work), and the barriers,
global loads (LDG; LDGSTS: cp.async into shared memory, the software-pipelined loads) and shuffles one program
runs through in a row; "issue µs" = warp-instructions / (4 per clock × 1.98 GHz), the least SM time a partition
takes when nothing else limits it.
"""
import json
import os
import re
import sys

from benchmarks.common import table

ISSUE_PER_US = 4 * 1.98e3


def rows(res: dict) -> list[list]:
    out = []
    for w in [w for w in res["workloads"] if w["name"].startswith("lagkv") and not w["error"]]:
        x = next(x for x in w["sequence"] if x["type"] == "triton")
        k = next(k for k in res["kernels"] if k["label"] == x["name"])
        for arch, st in sorted(k["archs"].items(), reverse=True):
            loops = st["loops"]
            # the partition loop: the outer loop holding others (chunked), else the largest (whole partitions)
            outer = [i for i, L in enumerate(loops) if L["parent"] is None]
            part = next((i for i in outer if any(C["parent"] == i for C in loops)),
                        max(outer, key=lambda i: loops[i]["own_n"]))
            inner = [(L, x["loops"][i]["iterations"] / x["loops"][part]["iterations"])
                     for i, L in enumerate(loops) if L["parent"] == part or (L["parent"] is not None and
                                                                              loops[L["parent"]]["parent"] == part)]
            per = {op: loops[part]["own"][op] + sum(L["own"][op] * n for L, n in inner)
                   for op in ("BAR", "LDG", "LDGSTS", "SHFL")}
            n = loops[part]["own_n"] + sum(L["own_n"] * n for L, n in inner)
            out.append([w["name"], res["triton"], arch, st["regs"], f"{st['spill_stores']}/{st['spill_loads']}",
                        st["smem"], st["num_warps"], st["ctas_per_sm"], f"{st['occupancy']:.1%}", round(n),
                        round(n * st["num_warps"]), round(per["BAR"]), round(per["LDG"]), round(per["LDGSTS"]),
                        round(per["SHFL"]),
                        f"{n * st['num_warps'] / ISSUE_PER_US:.1f}", w["model_us"]["H100"] if arch == "sm_90" else ""])
    return out


def layouts() -> None:
    """Each tiling compiled for sm_90 (select mode, lag 128, D 128; bf16 and fp32; pointers and strides specialised
    16-byte aligned, as for contiguous K/V, and not): the layout along the channels (sizePerThread,
    threadsPerWarp, warpsPerCTA) of every fp32 ``[T, 128]`` sum over axis 1 in its TTGIR — the per-token std sums,
    whose order it fixes — against ``_channels``' prediction, and whether ``_tiling`` admits the tiling (it must
    give the default's layout)."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tritonkv.kernels import lagkv as kl

    names = kl._lagkv_kernel.arg_names
    print(f"Triton {triton.__version__}, sm_90: channel layout of the axis-1 fp32 sums, TTGIR / predicted (per "
          "thread, lanes, warps)")
    for aligned in (True, False):
        for dt, item in (("bf16", 2), ("fp32", 4)):
            for tile, warps in kl.TILINGS:
                bl, bt, bd, bj, w = kl._tiling(128, 128, item, tile, warps)  # compiled unaligned even if refused
                try:
                    kl._tiling(128, 128, item, tile, warps, aligned)
                    verdict = "admitted"
                except ValueError:
                    verdict = "refused"
                sig = {a: "i32" for a in names}
                sig.update({a: "*" + dt for a in ("k_ptr", "v_ptr", "ko_ptr", "vo_ptr")}, out_ptr="*i64",
                           tmp_ptr="*fp32", eps="fp32", **{a: "i64" for a in ("skb", "skh", "skn", "svb", "svh", "svn")})
                const = dict(D=128, lag=128, BLOCK_L=bl, BLOCK_T=bt, BLOCK_D=bd, BLOCK_J=bj, MODE=2,
                             STAGES=kl.STAGES)
                sig.update(dict.fromkeys(const, "constexpr"))
                attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if aligned and
                         a in ("k_ptr", "v_ptr", "skb", "skh", "skn", "svb", "svh", "svn")}
                ttgir = triton.compile(ASTSource(kl._lagkv_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                                       options={"num_warps": w}).asm["ttgir"]
                lay = dict(re.findall(r"^(#\w+) = #ttg\.blocked<\{(.*?)\}>", ttgir, re.M))
                used = re.findall(r"\}\) : \(tensor<\d+x128xf32, (#\w+)>\) -> tensor<\d+xf32, #ttg\.slice<\{dim = 1",
                                  ttgir)
                along = sorted({tuple(int(v.split(",")[1]) for v in re.findall(
                    r"(?:sizePerThread|threadsPerWarp|warpsPerCTA) = \[([\d, ]+)\]", lay[u])) for u in used})
                print(f"- {'aligned' if aligned else 'unaligned'} {dt} tile={tile} warps={warps} ([{bt}, {bd}] over "
                      f"{w} warps): {', '.join(map(str, along))} / {kl._channels(bt, bd, 16 // item if aligned else 1, w)}"
                      f" ({len(used)} sums); {verdict}")


def main(paths) -> None:
    res = [json.load(open(p)) for p in paths]
    print("# LagKV's tilings: compile-time evidence (no GPU)\n")
    print(next(p for p in __doc__.split("\n\n") if p.startswith("Per partition")).strip() + "\n")
    print(f"Shape: N = {res[0]['shape']['N']}, B 1, H_kv 8, D 128, bf16, lag 128, keep 25 % (254 scored partitions\n"
          "a row, 2,032 in all); the grid is the automatic one of each tiling. Model H100 µs: kernel_stats'\n"
          "max(bytes, issue) for the whole launch — not a measurement; the default measured 267 µs on an H100\n"
          "(2026-11-26, the kernel before the tilings), latency-bound.\n")
    print("\n".join(table([r for x in res for r in rows(x)], None, [
        "workload", "Triton", "arch", "regs", "spill st/ld B", "smem B", "warps", "CTAs/SM (partitions in flight)",
        "occupancy", "instr./partition (a warp)", "warp-instr./partition", "BAR/partition", "LDG/partition",
        "LDGSTS/partition", "SHFL/partition", "issue µs/partition", "model H100 µs"], right=True)))


if __name__ == "__main__":
    layouts() if sys.argv[1:] == ["--layouts"] else main(sys.argv[1:])
