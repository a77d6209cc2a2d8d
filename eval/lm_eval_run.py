"""lm-eval tasks on a causal LM, full precision vs quantpatch modes (and calibrated checkpoints), offline.

    python eval/lm_eval_run.py --model ../shared/models/pydoc-llama-21m --data ../shared/data/pydoc-val.jsonl \
        --modes sage2-8b sage2-4b --tasks pydoc_perplexity pydoc_choice --max-length 1024 --out lm_eval.json
    quantpatch eval lm --model ... (the same arguments)

The model is loaded once; lm-eval's ``HFLM`` wraps that model object (``pretrained=model``) and
every mode is evaluated by patching it in place (``quantpatch.patch_model``) and removing the
patch afterwards. ``--checkpoint DIR`` adds a row per checkpoint written by ``quantpatch
calibrate`` (rebuilt by ``quantpatch.load(DIR, patch_attention=True)``).

Tasks: the local ones are the templates ``eval/lm_eval_tasks/*.yaml.tmpl``, rendered with the
``--data`` jsonl path into a temporary directory that lm-eval's ``TaskManager(include_path=...)``
reads (lm-eval's own ``json`` loader reads the file): ``pydoc_perplexity`` (loglikelihood_rolling)
and ``pydoc_choice`` (multiple choice, built as ``eval/lm_eval_tasks/utils.py`` describes). Any
other name is one of lm-eval's tasks: it runs when its data is in the local Hugging Face cache and
is reported as skipped otherwise (``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1`` unless set).

Perplexity: besides lm-eval's word/byte perplexity and bits per byte, each loglikelihood_rolling
task gets ``token_perplexity`` = ``exp(-Σ loglikelihood / Σ tokens)``, the per-document
loglikelihoods taken from lm-eval's logged samples and the tokens counted by the same HFLM's
``tok_encode``. ``eval/perplexity.py --lm-eval-windows`` computes the same quantity without lm-eval.
Requests run one at a time (``--batch-size 1``): padding a batch would change quantized attention
(smoothing means and block scales see the padding).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import string
import tempfile
import time
from pathlib import Path

import torch

import quantpatch
from quantpatch.environment import environment_info, write_json

logger = logging.getLogger("quantpatch.eval")

REPO = Path(__file__).resolve().parents[1]
TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TEMPLATE_SUFFIX = ".yaml.tmpl"


def render_tasks(data_file: str | Path, out_dir: Path, tasks_dir: Path = TASKS_DIR) -> list[str]:
    """Render the task templates of ``tasks_dir`` with ``data_file`` into ``out_dir``; returns their task names.

    Each ``NAME.yaml.tmpl`` (task name ``NAME``) becomes ``NAME.yaml`` with ``${data_file}`` replaced
    by the absolute path; the ``.py`` files beside the templates (``!function`` targets) are copied.
    """
    data_file = Path(data_file).resolve()
    if not data_file.is_file():
        raise FileNotFoundError(f"local task data {data_file} does not exist")
    names = []
    for template in sorted(tasks_dir.glob(f"*{TEMPLATE_SUFFIX}")):
        name = template.name.removesuffix(TEMPLATE_SUFFIX)
        text = string.Template(template.read_text()).substitute(data_file=json.dumps(str(data_file)))
        (out_dir / f"{name}.yaml").write_text(text)
        names.append(name)
    for module in tasks_dir.glob("*.py"):
        shutil.copy(module, out_dir)
    return names


def resolve_tasks(names: list[str], task_manager) -> tuple[list[str], dict[str, str]]:
    """The tasks of ``names`` whose data loads (offline), and ``{name: why}`` for the others."""
    runnable, skipped = [], {}
    for name in names:
        if name not in task_manager.all_tasks:
            skipped[name] = "unknown task name (neither local nor one of lm-eval's)"
            continue
        try:
            task_manager.load([name])  # builds the task: loads its dataset
        except Exception as err:  # datasets raises many types (connection, not-found, offline-mode errors)
            skipped[name] = f"data not available offline: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
            continue
        runnable.append(name)
    for name, why in skipped.items():
        logger.warning("skipping task %s: %s", name, why)
    return runnable, skipped


def _metrics(task_result: dict) -> dict[str, float]:
    """``{"acc": 0.8, "acc_stderr": ...}`` from lm-eval's ``{"acc,none": 0.8, "acc_stderr,none": ..., ...}``."""
    out = {}
    for key, value in task_result.items():
        metric, _, filt = key.partition(",")
        if filt and isinstance(value, (int, float)):
            out[metric if filt == "none" else f"{metric},{filt}"] = float(value)
    return out


def evaluate(lm, tasks: list[str], task_manager, limit: int | None, bootstrap_iters: int) -> dict[str, dict]:
    """``{task: {metric: value}}`` of one model; rolling tasks also get ``token_perplexity`` and ``tokens``."""
    from lm_eval import simple_evaluate

    out = simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, limit=limit, log_samples=True,
                          bootstrap_iters=bootstrap_iters)
    results = {}
    for task, task_result in out["results"].items():
        results[task] = _metrics(task_result)
        if out["configs"][task]["output_type"] == "loglikelihood_rolling":
            samples = out["samples"][task]
            loglikelihood = sum(float(s["filtered_resps"][0]) for s in samples)
            tokens = sum(len(lm.tok_encode(s["arguments"][0][0])) for s in samples)
            results[task].update(token_perplexity=math.exp(-loglikelihood / tokens), tokens=tokens,
                                 documents=len(samples))
    return results


def _load_model(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    return model.to(args.device).eval(), AutoTokenizer.from_pretrained(args.model)


def _hflm(model, tokenizer, args: argparse.Namespace):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size, max_length=args.max_length)


def run(args: argparse.Namespace) -> dict:
    """Evaluate ``fp``, each of ``args.modes`` and each ``args.checkpoint``; returns the JSON record."""
    from lm_eval.tasks import TaskManager

    from quantpatch.checkpoint import load as load_checkpoint
    from quantpatch.checkpoint import read_config

    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="quantpatch_lm_eval_tasks_") as tmp:
        local = render_tasks(args.data, Path(tmp)) if args.data else []
        task_manager = TaskManager(include_path=tmp if local else None)
        tasks, skipped = resolve_tasks(args.tasks, task_manager)
        if not tasks:
            raise SystemExit(f"no task can run: {skipped}")
        model, tokenizer = _load_model(args)
        lm = _hflm(model, tokenizer, args)
        for mode in ["fp", *args.modes]:
            start = time.perf_counter()
            if mode == "fp":
                rows[mode] = {"tasks": evaluate(lm, tasks, task_manager, args.limit, args.bootstrap_iters)}
            else:
                with quantpatch.patch_model(model, mode, policy="always") as handle:
                    rows[mode] = {"tasks": evaluate(lm, tasks, task_manager, args.limit, args.bootstrap_iters)}
                rows[mode]["fallbacks"] = {site: sorted(why) for site, why in handle.fallbacks().items()}
                rows[mode]["implementations"] = sorted({i for site in handle.sites for i in site.implementations})
            rows[mode]["seconds"] = time.perf_counter() - start
        for directory in args.checkpoint:
            start = time.perf_counter()
            ckpt = load_checkpoint(directory, device=args.device, patch_attention=True)
            ckpt_tokenizer = tokenizer
            if (Path(directory) / "tokenizer_config.json").is_file():
                from transformers import AutoTokenizer

                ckpt_tokenizer = AutoTokenizer.from_pretrained(directory)
            name = f"ckpt:{Path(directory).name}"
            rows[name] = {"tasks": evaluate(_hflm(ckpt, ckpt_tokenizer, args), tasks, task_manager, args.limit,
                                            args.bootstrap_iters),
                          "mode": read_config(directory)["mode"],
                          "seconds": time.perf_counter() - start}
    return {
        "environment": environment_info(args.device, REPO),
        "lm_eval": _version("lm_eval"),
        "datasets": _version("datasets"),
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "tasks_run": tasks,
        "tasks_skipped": skipped,
        "results": rows,
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package.replace("_", "-"))
    except PackageNotFoundError:
        return None


SHOWN = ("token_perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "acc", "acc_norm")


def table(report: dict) -> str:
    """One line per (task, metric), one column per row (fp first) with its change relative to fp in %."""
    rows = report["results"]
    names = list(rows)
    lines = [f"{'task':<20} {'metric':<18} " + " ".join(f"{n:>22}" for n in names)]
    for task in report["tasks_run"]:
        metrics = rows["fp"]["tasks"][task]
        shown = [m for m in SHOWN if m in metrics] or [m for m in metrics if not m.endswith("_stderr")]
        for metric in shown:
            cells = []
            for name in names:
                value, base = rows[name]["tasks"][task][metric], metrics[metric]
                delta = "" if name == "fp" or base == 0 else f" ({100 * (value / base - 1):+.2f}%)"
                cells.append(f"{value:.4f}{delta}")
            lines.append(f"{task:<20} {metric:<18} " + " ".join(f"{c:>22}" for c in cells))
    lines += [f"skipped {task}: {why}" for task, why in report["tasks_skipped"].items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quantpatch eval lm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Transformers causal LM directory (AutoModelForCausalLM)")
    parser.add_argument("--modes", nargs="*", default=["sage2-8b", "sage2-4b"],
                        choices=[m for m in quantpatch.available_modes() if m != "off"])
    parser.add_argument("--checkpoint", nargs="*", default=[], help="quantpatch checkpoint dirs, one row each")
    parser.add_argument("--tasks", nargs="+", default=["pydoc_perplexity", "pydoc_choice"],
                        help="local task names (eval/lm_eval_tasks) and/or lm-eval task names")
    parser.add_argument("--data", default=None, help="jsonl with a 'text' field for the local tasks")
    parser.add_argument("--limit", type=int, default=None, help="first N documents (items) of each task")
    parser.add_argument("--max-length", type=int, default=None, help="HFLM max_length (default: the model's)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--bootstrap-iters", type=int, default=100, help="lm-eval stderr bootstrap (0: none)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    return parser


def main(argv: list[str] | None = None) -> dict:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    report = run(args)
    env = report["environment"]
    print(f"lm-eval {report['lm_eval']} on {args.model}, {args.dtype} on {env['device']} ({env['machine']}), "
          f"max_length {args.max_length or 'model default'}, limit {args.limit}")
    print(table(report))
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
