"""`python -m train.plan`: the memory planner of a mesh: the documented path; the code lives in
`train.parallel.plan`."""

from train.parallel.plan import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
