"""``python -m tritonkv <command>``; commands: ``demo`` (see ``tritonkv.demo``)."""
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m tritonkv demo [options]   (python -m tritonkv demo --help)")
        return 0
    if argv[0] == "demo":
        from .demo import main as demo

        demo(argv[1:])
        return 0
    print(f"unknown command {argv[0]!r}; known: demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
