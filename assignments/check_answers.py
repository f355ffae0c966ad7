"""
Check the numbers block of the written answers against the student's own runs (the last evaluation in each
run folder's log.jsonl), within a relative tolerance. Prose answers are graded by hand.

    python assignments/check_answers.py                          # assignments/ANSWERS.md, runs under out/
    python assignments/check_answers.py my_answers.md --runs=out --tolerance=0.02
"""

import argparse
import json
import os
import re
import sys

# key -> (run folder under --runs, what to read from its last evaluation record)
CHECKS = {
    'a5_normed_norm_loop1': ('laptop-normed', lambda r, K: r['hidden_norm'][0]),
    'a5_normed_norm_loop4': ('laptop-normed', lambda r, K: r['hidden_norm'][K - 1]),
    'a5_rmsnorm_norm_K': ('laptop', lambda r, K: r['hidden_norm'][K - 1]),
    'a5_penalty_norm_K': ('laptop-pen0.01', lambda r, K: r['hidden_norm'][K - 1]),
    'a6_alpha_per_loop': ('laptop-alpha', lambda r, K: r['alpha']),
    'a6_alpha_terminal': ('laptop-terminal-alpha', lambda r, K: r['alpha']),
}


def reported_numbers(text):
    """{key: float or None} from 'key = value' lines; '?' or anything unparsable is None."""
    out = {}
    for key, value in re.findall(r'^\s*([A-Za-z0-9_]+)\s*=\s*(\S*)\s*$', text, flags=re.M):
        try:
            out[key] = float(value.replace(',', ''))
        except ValueError:
            out[key] = None
    return out


def measured(runs, folder, read):
    path = os.path.join(runs, folder, 'log.jsonl')
    if not os.path.exists(path):
        return None, f"no {path} (run the command in the question first)"
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if len(lines) < 2:
        return None, f"{path} has no evaluation yet"
    try:
        return read(lines[-1], lines[0]['config']['model']['n_loop']), None
    except (KeyError, IndexError):
        return None, f"{path} does not have this number (was it trained with the flags the question gives?)"


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda msg: sys.exit(f"check_answers.py: error: {msg}")
    p.add_argument('answers', nargs='?', default=os.path.join(os.path.dirname(os.path.abspath(__file__)), 'ANSWERS.md'))
    p.add_argument('--runs', default='out', help='the folder that holds the run folders')
    p.add_argument('--tolerance', type=float, default=0.02, help='relative tolerance')
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    try:
        with open(args.answers, encoding='utf-8') as f:
            numbers = reported_numbers(f.read())
    except OSError as e:
        p.error(f"cannot read {args.answers}: {e.strerror}")
    ok = 0
    for key, (folder, read) in CHECKS.items():
        value, problem = measured(args.runs, folder, read)
        given = numbers.get(key)
        if problem:
            verdict = f"not checked: {problem}"
        elif given is None:
            verdict = f"missing (your run says {value:.4g})"
        elif abs(given - value) <= args.tolerance * abs(value):
            verdict, ok = f"ok ({given:g}, run {value:.4g})", ok + 1
        else:
            verdict = f"differs: you wrote {given:g}, {folder} says {value:.4g}"
        print(f"{key:<24} {verdict}")
    print(f"{ok} of {len(CHECKS)} numbers match your runs")
    return 0 if ok == len(CHECKS) else 1


if __name__ == '__main__':
    sys.exit(main())
