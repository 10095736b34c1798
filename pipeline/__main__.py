"""``python -m pipeline STAGE [--variant NAME] [--params PATH]``: run one stage.

User mistakes (``UserError``) print one line and exit with status 2; so does a stage run before the stage whose
output it reads (a ``FileNotFoundError`` for a file that ``files.producer`` knows: the line names that stage), and
a full filesystem (ENOSPC, EDQUOT: the folder and its free space; a stage's folders are replaced all together or not
at all, ``files.StagedFolder``, so the previous outputs are intact). Anything else is a bug and keeps its traceback.

Params are validated before torch is imported (a typo costs no torch start-up), and params ``threads`` is
applied then too: OMP_NUM_THREADS and MKL_NUM_THREADS (read once, when the libraries start) and, once the
stage has imported torch, torch's own intra-op and inter-op counts. The param wins over the environment,
because only the param is a DVC dependency: the thread count changes CPU bytes.

This module knows no device and starts no ranks: the stages that train call pipeline/launch.py themselves,
so that a stage which never touches a device (prepare, decide, report, publish) depends on none of that code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from pipeline.config import load_params
from pipeline.errors import UserError
from pipeline.quiet import silence_third_party_noise

STAGES = ("prepare", "freeze", "trial", "compare", "diagnose", "decide", "benchmark", "report", "publish", "restore")
PER_VARIANT = {"trial", "compare", "diagnose", "decide", "benchmark", "restore"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description="Run one stage of the AMP validation pipeline.")
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--variant", help="the trial variant of a per-variant stage: a name in params trial.variants")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    silence_third_party_noise()  # torchao's unloadable extensions, logged by every stage that builds a HF model
    try:
        params = load_params(args.params)  # a mistake in params.yaml is reported before torch is even imported
        if args.stage in PER_VARIANT:
            if not args.variant:
                raise UserError(f"stage {args.stage} needs --variant NAME, one of trial.variants {params.trial.variants}")
            params.trial.policy(args.variant)  # a name that is not a variant: one line, before torch
        set_thread_env(params.threads, os.environ)
        if getattr(params.reference, "deterministic", False):
            # cuBLAS reads it when it starts: before torch, to be sure (precision.deterministic sets it too).
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        module = importlib.import_module(f"pipeline.stages.{args.stage}")
        if "torch" in sys.modules:  # the stage computes: fix torch's own counts before it starts
            set_torch_threads(params.threads)
        kwargs = {"variant": args.variant} if args.stage in PER_VARIANT else {}
        module.main(params_path=args.params, **kwargs)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:  # an earlier stage's output read before that stage ran: name it
        from pipeline.files import missing_input

        line = missing_input(exc)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk outside a staged folder (the resume state, a metrics file): one line too
        from pipeline.files import disk_full, no_space

        if not disk_full(exc):
            raise
        where = os.path.dirname(exc.filename) if isinstance(exc.filename, str) and exc.filename else "data"
        print(f"error: {no_space(where)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; outputs are written atomically, rerun the stage to finish", file=sys.stderr)
        return 130
    return 0


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def set_thread_env(threads: int | None, environ: dict) -> None:
    """Params ``threads`` into the variables the CPU libraries read at start (None: leave the environment)."""
    if threads is not None:
        for name in THREAD_VARIABLES:
            environ[name] = str(threads)


def set_torch_threads(threads: int | None) -> None:
    """Set torch's intra-op and inter-op thread counts (params ``threads``; None leaves torch's defaults).

    The environment (``set_thread_env``) gives the libraries that count when they start; this sets it in
    torch itself, which also holds when torch was imported before (a test calling ``main``). The inter-op
    count (recorded in every manifest) can only be set before inter-op work starts: once it has, it is left
    as it is (it does not change any result).
    """
    if threads is None:
        return
    import torch  # already imported by the stage: this costs nothing

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already started (or already set): inter-op threads only run independent ops
        pass


if __name__ == "__main__":
    sys.exit(main())
