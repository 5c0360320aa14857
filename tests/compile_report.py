"""Sum a test run's compile log (`EE_COMPILE_LOG=FILE pytest ...`; see
conftest.py): the slowest tests and files, with what each spent compiling.

    python tests/compile_report.py FILE [--top 25]
"""

import argparse
import collections
import glob
import json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows = []
    for path in sorted(glob.glob(args.log + ".*")):
        with open(path) as log:
            rows += [json.loads(line) for line in log]
    fields = ("wall", "compiles", "compile", "trace", "lower")
    total = {f: sum(r[f] for r in rows) for f in fields}
    print(
        f"{len(rows)} tests: {total['wall']:.0f} s in tests, {total['compiles']} "
        f"compilations taking {total['compile']:.0f} s, tracing {total['trace']:.0f}"
        f" s, lowering {total['lower']:.0f} s"
    )
    files: dict[str, dict[str, float]] = collections.defaultdict(
        lambda: dict.fromkeys(fields, 0.0)
    )
    for row in rows:
        for f in fields:
            files[row["test"].split("::")[0]][f] += row[f]
    header = "| {} | wall s | compiles | compile s | trace s | lower s |"
    print("\n" + header.format("file") + "\n|---|---:|---:|---:|---:|---:|")
    for name, row in sorted(files.items(), key=lambda kv: -kv[1]["wall"])[: args.top]:
        print(_row(name, row))
    print("\n" + header.format("test") + "\n|---|---:|---:|---:|---:|---:|")
    for row in sorted(rows, key=lambda r: -r["wall"])[: args.top]:
        print(_row(row["test"], row))


def _row(name: str, row: dict) -> str:
    return (
        f"| `{name}` | {row['wall']:.1f} | {int(row['compiles'])} | "
        f"{row['compile']:.1f} | {row['trace']:.1f} | {row['lower']:.1f} |"
    )


if __name__ == "__main__":
    main()
