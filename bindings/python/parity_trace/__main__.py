"""python -m parity_trace GOLDEN_DIR OUT_DIR: copy a golden's tensors through the writer (a
self-check: `parity diff GOLDEN_DIR OUT_DIR` then says parity, bit-identical)."""
import sys

from parity_trace import copy_trace


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    w = copy_trace(argv[0], argv[1])
    print(f"wrote {argv[1]}: {len(w.steps)} steps, {len(w.tensors)} taps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
