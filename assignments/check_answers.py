"""
Check the numbers block of the written answers against the student's own runs, and (where the instructor's
answer key is present) against the key's reference ranges. Prose answers are graded by hand.

    python assignments/check_answers.py                          # assignments/ANSWERS.md, runs under out/
    python assignments/check_answers.py my_answers.md --runs=out --tolerance=0.02

A number is read from the evaluation at the step its question names (500 for the laptop runs), and only from a
run that finished (its last evaluation is at its --max_iters) and was trained with the flags the question gives.
This script never prints a number you have not written: a missing or wrong answer is reported as such, without
the value, so the answer comes from your own reading of your run.
"""

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
KEY = os.path.join(HERE, 'key', 'key.json')  # the instructor's key; a student copy does not have it

# key -> (question, run folder under --runs, step the question names, flags the run must have, what to read)
CHECKS = {
    'a5_normed_norm_loop1': ('A5 Q3', 'laptop-recurrence_normed', 500, {'recurrence': 'normed', 'norm_penalty': 0.0},
                             lambda r, K: r['hidden_norm'][0]),
    'a5_normed_norm_loop4': ('A5 Q3', 'laptop-recurrence_normed', 500, {'recurrence': 'normed', 'norm_penalty': 0.0},
                             lambda r, K: r['hidden_norm'][K - 1]),
    'a5_rmsnorm_norm_K': ('A5 Q1', 'laptop', 500, {'readout': 'rmsnorm', 'norm_penalty': 0.0, 'recurrence': 'residual'},
                          lambda r, K: r['hidden_norm'][K - 1]),
    'a5_penalty_norm_K': ('A5 Q1', 'laptop-pen0.01', 500, {'readout': 'rmsnorm', 'norm_penalty': 0.01},
                          lambda r, K: r['hidden_norm'][K - 1]),
    'a6_alpha_per_loop': ('A6 Q2', 'laptop-readout_alpha', 500, {'readout': 'alpha', 'supervision': 'per_loop'},
                          lambda r, K: r['alpha']),
    'a6_alpha_terminal': ('A6 Q2', 'laptop-supervision_terminal-readout_alpha', 500,
                          {'readout': 'alpha', 'supervision': 'terminal'},
                          lambda r, K: r['alpha']),
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


def key_ranges(path=KEY):
    """{key: (low, high)} for the numbers the answer key has a measured range for; {} without the key."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding='utf-8') as f:
        numbers = json.load(f)['numbers']
    return {k: tuple(v['range']) for k, v in numbers.items() if v.get('range')}


def measured(runs, folder, step, flags, read):
    """(value, None) from the run's evaluation at `step`, or (None, why not) when the run cannot answer."""
    path = os.path.join(runs, folder, 'log.jsonl')
    if not os.path.exists(path):
        return None, f"no {path} (run the command in the question first)"
    try:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        config = lines[0]['config']
        K = config['model']['n_loop']
    except (ValueError, KeyError, IndexError, TypeError):
        return None, f"{path} is not a train.py log (no header)"
    records = [r for r in lines[1:] if 'step' in r]
    if not records:
        return None, f"{path} has no evaluation yet"
    last = records[-1]['step']
    if config.get('max_iters') != step:
        return None, (f"{folder} was trained for --max_iters={config.get('max_iters')}; the question names step "
                       f"{step}: train it with the command the question gives")
    if last < step:
        return None, (f"{folder} stopped at step {last} of {step} (unfinished): finish it with the same command "
                       f"plus --resume, then check again")
    wrong = [f"--{k}={config['model'].get(k, config.get(k))}" for k, v in flags.items()
             if config['model'].get(k, config.get(k)) != v]
    if wrong:
        return None, f"{folder} was trained with {', '.join(wrong)}, not the flags the question gives"
    record = next(r for r in records if r['step'] == step)
    try:
        return float(read(record, K)), None
    except (KeyError, IndexError, TypeError):
        return None, f"{path} does not have this number at step {step}"


def get_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda msg: sys.exit(f"check_answers.py: error: {msg}")
    p.add_argument('answers', nargs='?', default=os.path.join(HERE, 'ANSWERS.md'))
    p.add_argument('--runs', default='out', help='the folder that holds the run folders')
    p.add_argument('--tolerance', type=float, default=0.02, help='relative tolerance against your own runs')
    p.add_argument('--key', default=KEY, help=argparse.SUPPRESS)  # the instructor's key.json (tests point it elsewhere)
    return p


def main(argv=None):
    p = get_parser()
    args = p.parse_args(argv)
    if not 0 <= args.tolerance < 1:
        p.error(f"--tolerance must be in [0, 1), got {args.tolerance:g}")
    try:
        with open(args.answers, encoding='utf-8') as f:
            numbers = reported_numbers(f.read())
    except OSError as e:
        p.error(f"cannot read {args.answers}: {e.strerror}")
    try:
        ranges = key_ranges(args.key)
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"cannot read the answer key {args.key}: {e}")
    ok = 0
    for key, (question, folder, step, flags, read) in CHECKS.items():
        value, problem = measured(args.runs, folder, step, flags, read)
        given = numbers.get(key)
        if given is None:
            verdict = f"missing: write the number from {folder}'s evaluation at step {step} ({question})"
        elif problem:
            verdict = f"not checked: {problem}"
        elif abs(given - value) > args.tolerance * abs(value):
            verdict = (f"differs: you wrote {given:g}, which is not within {args.tolerance:.0%} of {folder}'s "
                       f"evaluation at step {step}: read it again from its log")
        elif key in ranges and not ranges[key][0] <= given <= ranges[key][1]:
            verdict = (f"outside the key: you wrote {given:g}, which matches your run but not the answer key's "
                       f"reference range (3 seeds): check your implementation and the command's flags")
        else:
            verdict, ok = f"ok ({given:g}" + (", within the key's range)" if key in ranges else ")"), ok + 1
        print(f"{key:<24} {verdict}")
    print(f"{ok} of {len(CHECKS)} numbers match your runs" + (" and the answer key" if ranges else ''))
    return 0 if ok == len(CHECKS) else 1


if __name__ == '__main__':
    sys.exit(main())
