"""`palu-annotate`: make and check span-annotation files."""

import argparse

from palu_trainer.annotations import import_tpo


def annotate_main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="palu-annotate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    tpo = commands.add_parser("import-tpo", help="convert TPO-style span annotations (char offsets)")
    tpo.add_argument("tpo_file", help="JSON lines with `answer` and `spans: [{start, end}]`")
    tpo.add_argument("out_file", help="annotation file to write (span_annotations/ format)")
    args = parser.parse_args(argv)
    if args.command == "import-tpo":
        rows = import_tpo(args.tpo_file, args.out_file)
        print(f"wrote {rows} rows to {args.out_file}")
