"""
What every tool writes, written one way: markdown tables, CSV files and figures (a PNG and an SVG), each through a
fresh temporary file renamed over its destination (data/common.py write_atomically: a link planted there is
replaced, never followed, and an interrupted write leaves the old file whole). And the tools' command line: the
flags they share, the checks made before any work, and the one line a command stops with when something is
wrong, named for the command as the user types it ('train.py', 'python -m lab.atlas'). And the two lines train.py
prints as it trains (Report: the eval line, with what each design that is on has learned, and the progress line).
"""

import argparse
import csv
import io
import os
import shlex
import sys

import numpy as np
import torch

from data.common import check_writable, write_atomically
from lab.configs import CONFIGS
from lab.designs import design_logs


def markdown(header, rows):
    """A markdown table's text, without a final newline: the header, the separator, then one line per row."""
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    return '\n'.join(lines + ['| ' + ' | '.join(map(str, row)) + ' |' for row in rows])


def write_text(path, text):
    """Write text (a table, say) as UTF-8 at path, atomically."""
    write_atomically(path, lambda f: f.write(text.encode('utf-8')))


def write_csv(path, rows, lineterminator='\r\n'):
    """Write rows (lists of cells) as CSV at path, atomically. The line ends are the csv module's own, \\r\\n, as
    the committed tables have them; matched_depth.csv has always had \\n, and keeps it."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator=lineterminator).writerows(rows)
    write_text(path, buf.getvalue())


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed), imported only when a figure is
    drawn: a tool's tables and its --help need no matplotlib."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi=130):
    """Lay fig out, write it as a PNG at path and as an SVG beside it (the same name, .svg: for papers and slides),
    each atomically, then close it. Returns path. No date and fixed SVG ids: the same logs give the same bytes,
    so rebuilding a committed figure shows no change unless its data changed."""
    fig.tight_layout()
    write_atomically(path, lambda f: fig.savefig(f, format='png', dpi=dpi))
    with pyplot().rc_context({'svg.hashsalt': 'looped'}):
        write_atomically(os.path.splitext(path)[0] + '.svg',
                         lambda f: fig.savefig(f, format='svg', metadata={'Date': None}))
    pyplot().close(fig)
    return path


def fail(prog, message):
    """Stop the command with one line on stderr and exit status 1: '<prog>: error: <message>'."""
    sys.exit(f"{prog}: error: {message}")


def one_line_errors(parser, prog):
    """Make parser.error (argparse's own, and every later check of the flags that calls it) stop with one line
    that names prog, the command as the user types it ('train.py', 'python -m lab.atlas'), instead of argparse's
    usage block, which is longer than a screen here. Returns parser."""
    parser.error = lambda message: fail(prog, message)
    return parser


def tool_parser(prog, doc):
    """A command's parser: prog in its usage line and its errors, the module's docstring as written for --help."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return one_line_errors(p, prog)


def train_flags(p, config, out_root, example):
    """The flags of a tool that trains its runs (through grid.run_grid) before it reads them: the configuration,
    where the run folders go, and extra train.py flags as one quoted string (example: one, for the help)."""
    p.add_argument('--config', default=config, choices=list(CONFIGS), help='train.py configuration of the runs')
    p.add_argument('--out_root', default=out_root, help='where the runs it trains go (and are found again)')
    p.add_argument('--train_args', default='', help=f"extra train.py flags for the runs it trains, e.g. '{example}'")


def runs_flags(p, what, config, out_root, example):
    """The flags of a tool that reads the run folders named, or with --run trains its own first (what: those
    runs, for the help), and train_flags."""
    p.add_argument('runs', nargs='*', help=f'run folders or quoted globs (default with --run: {what})')
    p.add_argument('--run', action='store_true', help=f'train {what} first (reusing finished runs)')
    train_flags(p, config, out_root, example)


def grid_folder_flags(p, committed, fig_dir):
    """The folder flags of a grid tool: where its finished runs' logs are committed (a run finished there is not
    trained again) and where its tables and figures go."""
    p.add_argument('--committed', default=committed,
                   help="--run: where the finished runs' logs are committed; a run finished there is not trained "
                        'again')
    p.add_argument('--fig_dir', default=fig_dir,
                   help='where table.md and the figures go (a committed table changes only when its folder is '
                        'named here)')


def grid_parser(prog, doc, what, name, part=False):
    """The parser of a grid tool (name: cost, converge, interaction): the run folders it reads, or with --run
    trains first (what: those runs, for the help) under out/<name>; with part, --part for several workers; its
    logs committed in figures/<name>/runs; its table and figures written to out/<name>_figures."""
    p = tool_parser(prog, doc)
    runs_flags(p, what, 'laptop', os.path.join('out', name), '--device=cpu')
    if part:
        p.add_argument('--part', default='1/1', help="--run: 'i/n' trains jobs i, i + n, ... of the list only, so "
                                                     'n workers (one thread each) share the runs')
    grid_folder_flags(p, os.path.join('figures', name, 'runs'), os.path.join('out', name + '_figures'))
    return p


def parse_part(p, text):
    """--part's 'i/n' as (i, n); parser p's one-line error for anything else."""
    try:
        i, n = map(int, text.split('/'))
    except ValueError:
        p.error(f"--part={text}: give i/n, e.g. 1/2")
    if not 1 <= i <= n:
        p.error(f"--part={text}: i must be between 1 and n")
    return i, n


def write_outputs(fig_dir, text, figures):
    """A grid tool's outputs: table.md holding text, then each figure (a dict of file name -> draw(path)), and
    the table printed with what was written."""
    write_text(os.path.join(fig_dir, 'table.md'), text)
    for name, draw in figures.items():
        draw(os.path.join(fig_dir, name))
    written = [os.path.join(fig_dir, 'table.md'), *figures]
    names = f"{', '.join(written[:-1])} and {written[-1]}" if len(written) > 1 else written[0]
    print(text + f"wrote {names}")


def at_least(p, flag, value, least, why=''):
    """Parser p's one-line error when a flag's value is below the least it can be (None: not given, so nothing
    to check), with the reason in brackets where it is not obvious."""
    if value is not None and value < least:
        p.error(f"{flag}={value} must be at least {least}" + (f" ({why})" if why else ''))


def check_destination(p, path, flag):
    """Before any work (hours of training, minutes of measuring): parser p's one-line error, naming flag, when
    path cannot be written, so that the error comes first and not after the work."""
    try:
        check_writable(path)
    except ValueError as e:
        p.error(f"{flag}: {e}")


def split_flags(p, text, flag='--train_args'):
    """The extra train.py flags given as one quoted string, split as the shell would; parser p's one-line error
    for one it cannot split (an unclosed quote, say)."""
    try:
        return shlex.split(text)
    except ValueError as e:
        p.error(f"{flag}={text!r}: {e}")


def run_main(main, prog):
    """Run a tool's main; Ctrl-C outside a training run (reading logs, drawing) has nothing to save, so it stops
    with one line and the shell's status for an interrupt, not a traceback."""
    try:
        main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)


# ---- train.py's printed lines: the eval line (with what each design that is on has learned) and the progress line

def design_values(model, batch, ctx):
    """What the designs that are on have learned or estimate, for the log and the eval line (train.py
    logs the turn and alpha itself): each design's Logged values (lab/designs.py's DESIGNS), those read
    off the model first, then those of one validation batch at K loops, run only if one is on."""
    values, asked = {}, []
    for log in design_logs():
        if log.read is None:
            asked += [log] if log.on(model) else []
        elif (value := log.read(model)) is not None:
            values[log.key] = value
    if asked:
        model.eval()  # one validation batch at K loops (STARS's estimate needs a graph)
        with torch.set_grad_enabled(any(log.grad for log in asked)), ctx:
            stats = model(*batch)[2]
        model.train()
        values.update({log.key: stats[log.key].tolist() for log in asked if log.key in stats})
    return values


def design_line(record):
    """design_values' part of train.py's eval line: ' | decay mean ... | exit p ...' ('' if none)."""
    show = lambda log, v: log.show(v) if callable(log.show) else log.show.format(*np.atleast_1d(v))
    return ''.join(f" | {show(log, record[log.key])}" for log in design_logs() if log.key in record)
