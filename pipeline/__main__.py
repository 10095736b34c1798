"""``python -m pipeline STAGE [--dtype DTYPE] [--params PATH]``: run one stage.

User mistakes (``UserError``) print one line and exit with status 2; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pipeline.config import DTYPES, load_params
from pipeline.errors import UserError

STAGES = ("prepare", "freeze", "trial", "compare", "diagnose", "decide", "benchmark", "report", "publish", "restore")
PER_DTYPE = {"trial", "compare", "diagnose", "decide", "benchmark", "restore"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description="Run one stage of the AMP validation pipeline.")
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--dtype", help="autocast dtype of a per-dtype stage: float16 or bfloat16")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    try:
        if args.stage in PER_DTYPE and not args.dtype:
            raise UserError(f"stage {args.stage} needs --dtype (float16 or bfloat16)")
        if args.dtype is not None and args.dtype not in DTYPES:
            raise UserError(f"--dtype {args.dtype}: unknown dtype; use one of {', '.join(DTYPES)}")
        load_params(args.params)  # a mistake in params.yaml is reported before torch is even imported
        module = importlib.import_module(f"pipeline.stages.{args.stage}")
        kwargs = {"dtype": args.dtype} if args.stage in PER_DTYPE else {}
        module.main(params_path=args.params, **kwargs)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; outputs are written atomically, rerun the stage to finish", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
