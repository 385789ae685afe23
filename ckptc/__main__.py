"""``python -m ckptc``: the same command line as the ``ckptc`` console script."""

from ckptc.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
