"""The converter's command line: ``python -m recsdk.data.convert criteo IN... OUT [options]``.

Converts Criteo TSV files (plain or compressed, days in order) into a columnar dataset folder
that :class:`~recsdk.data.ColumnarDataset` reads; see :func:`~recsdk.data.convert_criteo` for
what is written, how units run in parallel and how a killed conversion resumes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from recsdk.data.criteo_convert import convert_criteo
from recsdk.data.criteo_fields import ON_BAD_LINE

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m recsdk.data.convert criteo IN... OUT [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m recsdk.data.convert", description="Convert data files into a columnar dataset."
    )
    kinds = parser.add_subparsers(dest="kind", required=True)
    criteo = kinds.add_parser("criteo", help="Criteo Kaggle / Terabyte TSV (plain or .gz) to a columnar dataset")
    criteo.add_argument(
        "paths", nargs="+", metavar="PATH", help="the input files in line order, then the output folder"
    )
    criteo.add_argument(
        "--workers", type=int, default=None, help="processes (default: one per 512 MiB of input, up to the CPU count)"
    )
    criteo.add_argument("--on-bad-line", choices=ON_BAD_LINE, default="error")
    criteo.add_argument("--rows-per-batch", type=int, default=1 << 18, help="rows per record batch (default 262144)")
    criteo.add_argument("--chunk-bytes", type=int, default=256 << 20, help="bytes of a plain file per unit of work")
    criteo.add_argument("--overwrite", action="store_true", help="replace a conversion of other inputs in OUT")
    criteo.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if len(args.paths) < 2:
        parser.error("give at least one input file and the output folder")
    *inputs, out = args.paths
    try:
        manifest = convert_criteo(
            inputs,
            out,
            workers=args.workers,
            on_bad_line=args.on_bad_line,
            rows_per_batch=args.rows_per_batch,
            chunk_bytes=args.chunk_bytes,
            overwrite=args.overwrite,
            progress=not args.quiet,
        )
    except (ValueError, TypeError, OSError) as e:  # a bad line, a corrupt or missing input, a locked OUT
        print("error: " + " ".join(str(e).split()), file=sys.stderr)  # one line
        return 2
    size = sum(p["bytes"] for p in manifest["parts"])
    seconds = manifest.get("seconds")
    rate = f", {manifest['rows'] / seconds:,.0f} rows/s" if seconds else " (already converted)"
    print(
        f"{out}: {manifest['rows']:,} rows from {len(manifest['sources'])} file(s), "
        f"{manifest['bad_lines']:,} bad lines skipped, {len(manifest['parts'])} parts, {size / 1e9:.2f} GB{rate}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
