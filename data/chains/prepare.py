"""
Chained variable assignment (pointer chasing), character level: a task whose answer takes a known
number of sequential lookups, so that a stack looped K times can do what one pass of it cannot.
Writes train.bin / val.bin (uint16 token ids) and meta.json (the vocabulary, the example layout and
the knobs).

    python -m data.chains.prepare                        # 2 hops, 2 chains, every letter queried
    python -m data.chains.prepare --hops=3 --out_dir=/tmp/chains_h3   # 6 answers at 1..3 lookups
    python -m data.chains.prepare --queries=one --hops=2 --min_hops=1  # one query, 1..2 hops
    python -m data.chains.prepare --queries=one --hops=4 --chains=3    # 4 lookups, 2 distractors
    python -m data.chains.prepare --seed=2 --out_dir=/tmp/chains2

Each example is one line of the same length. With --queries=one (the first pilot's format), e.g.
--hops=3 --chains=2:

    k=d;p=3;d=w;q=p;z=q;w=5?k=5

a shuffled list of assignments, then a query '?v=' and the answer digit, then a newline. The
assignments form --chains chains over distinct letters, each ending in its own digit: the query's
chain k=d, d=w, w=5 takes --hops lookups from the queried letter to its digit, and the others (z=q,
q=p, p=3) are distractors of the same shape, so that neither the digits present nor the letters'
places give the answer away: a reader that cannot follow the chain is right 1/--chains of the time
at best. With --min_hops below --hops the query's chain has a length drawn uniformly from
min_hops..hops per example (the distractors take the rest of the assignments), so every example
keeps the same length and layout.

With --queries=all (the default) every letter of every chain is queried once, in a shuffled
order, as '?' + letter + its digit, e.g. --hops=2 --chains=2 (chains a=b, b=5 and c=d, d=7):

    b=5;c=d;a=b;d=7?a5?d7?c7?b5

so an example carries chains * hops answers at 1..hops lookups (the letter assigned a digit takes
1, its predecessor 2, ...): dense supervision of the lookup, with the short lookups beside the
long ones. The order of the queries is drawn per example, so the hop count at an answer offset
varies; solve() gives each query's (answer, hops) from the line's text, which is how lab/answers.py
counts them. One caution: letters of a chain share its digit, so a query whose chain-mate was
answered earlier on the line can be answered from that answer by a shorter path than its hop count
(the first query of each chain has no such shortcut). And with chains of equal length every
digit is the answer exactly --hops times, so a reader that counts the answers seen so far beats
1/--chains without any lookup (2 chains x 3 hops: 0.683 expected, 1.0 on the last query; the pilot
at 1 layer found this and nothing else). --lengths=random closes that: each letter joins a chain
drawn uniformly (the chains' lengths vary, some past --hops, the example's length does not), so
the answers seen say nothing of the next new letter's (but for the rule that every chain keeps a
letter, a trace).

Why this task: it is the variable-chasing problem that the looped-transformer papers use to separate
depth from parameters (the p-hop induction heads of Sanford, Hsu and Telgarsky 2024, the
variable-assignment and multi-step tasks of Saunshi et al. 2025, "Reasoning with Latent Thoughts").
One lookup is an attention step (find the assignment whose left side is the current letter, read its
right side), so a fixed stack has a number of lookups it can chain in one pass, and looping it K
times multiplies that number while the parameters stay the same. The hop count is one knob that
moves the answer past one pass's reach, and since the examples are short (7 * chains * hops
characters with --queries=all: 28 at the defaults, 42 at 3 hops; 4 * chains * hops + 4 with
--queries=one) a window of block_size 128 holds whole examples.

What a short CPU run learns (pilots, one seed, raw readout, lr 3e-3, 1 layer x 64, 3,000-4,000
steps of 16 x 128 tokens, K=4 and K=1): with --queries=one, to answer with one of the chains'
digits (1/--chains right), not to follow a chain; with --queries=all and chains of equal length,
the answer-counting shortcut above (0.66 at 3 hops, flat over hop counts), still no lookup; with
--lengths=random, chance (0.50) at every hop count. Reading the answers needs longer training or
more layers. lab/answers.py measures every answer per exit depth and per hop count.

Every example is the same length, and its answers sit at fixed offsets, so the answer tokens of any
split are known without parsing: meta.json records example_len and answer_offsets (the answers are
the characters at those offsets of each example; the split starts with an example; --queries=one
also records its one offset as answer_offset), and the knobs.
The vocabulary is fixed (the 26 lowercase letters, the 10 digits, '=', ';', '?' and newline),
whatever the knobs, so datasets with different knobs share it. Running the script again with the
same flags rewrites the same bytes."""

import argparse
import os
import random
import string
import sys

from data.common import PrepareError, write_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
LETTERS = string.ascii_lowercase
DIGITS = string.digits
ITOS = ['\n', ';', '=', '?', *DIGITS, *LETTERS]  # id i is the character ITOS[i]: 40 in all
STOI = {ch: i for i, ch in enumerate(ITOS)}
QUERIES = ('all', 'one')  # the first is the default
LENGTHS = ('equal', 'random')


def layout(hops, chains, queries='one'):
    """(example_len, answer_offsets) of an example. 'one': chains * hops assignments of 4
    characters ('a=b;'), the last one's ';' being the query's '?', then the letter, '=', the answer
    digit and the newline: one answer. 'all': the n = chains * hops assignments joined by ';'
    (4n - 1 characters), then n queries of 3 ('?', the letter, its digit), then the newline: 7n
    characters, an answer at offsets 4n + 1, 4n + 4, ..., 4n + 1 + 3(n - 1)."""
    n = chains * hops
    if queries == 'all':
        return 7 * n, [4 * n + 1 + 3 * i for i in range(n)]
    return 4 * n + 4, [4 * n + 2]


def check_knobs(hops, chains, min_hops, queries='one', lengths='equal'):
    """PrepareError in one line for knobs that cannot make examples."""
    if queries not in QUERIES:
        raise PrepareError(f"--queries={queries}: one of {', '.join(QUERIES)}")
    if lengths not in LENGTHS:
        raise PrepareError(f"--lengths={lengths}: one of {', '.join(LENGTHS)}")
    if lengths == 'random' and queries != 'all':
        raise PrepareError("--lengths=random applies to --queries=all")
    if hops < 1:
        raise PrepareError(f"--hops={hops}: needs at least one lookup")
    if not 1 <= min_hops <= hops:
        raise PrepareError(f"--min_hops={min_hops} must be between 1 and --hops={hops}")
    if not 2 <= chains <= len(DIGITS):
        raise PrepareError(f"--chains={chains} must be between 2 and 10 (each chain ends in its "
                           "own digit, and one chain's digit is the answer without any lookup)")
    if chains * hops > len(LETTERS):
        raise PrepareError(f"--chains={chains} x --hops={hops} = {chains * hops} letters; there "
                           "are 26 (each assignment's left side is its own letter)")
    if queries == 'all' and min_hops != hops:
        raise PrepareError(f"--min_hops={min_hops} applies to --queries=one (with --queries=all "
                           "every chain is --hops long and each of its letters is queried)")


def make_example(rng, hops, chains, min_hops):
    """One --queries=one example as a string (newline included), drawn from rng (random.Random)."""
    n = chains * hops
    letters = rng.sample(LETTERS, n)
    digits = rng.sample(DIGITS, chains)
    h = rng.randint(min_hops, hops)
    rest, others = n - h, chains - 1
    # the distractors share the rest of the letters
    lengths = [h] + [rest // others + (i < rest % others) for i in range(others)]
    assignments, start = [], 0
    for length, digit in zip(lengths, digits):
        chain = letters[start:start + length] + [digit]
        assignments += [f"{a}={b}" for a, b in zip(chain, chain[1:])]
        start += length
    query = letters[0]  # the head of the first chain: h lookups from its digit, digits[0]
    rng.shuffle(assignments)
    example = ';'.join(assignments) + f"?{query}={digits[0]}\n"
    assert solve(example) == [(digits[0], h)], example  # the line says what it was built to say
    return example


def make_example_all(rng, hops, chains, lengths='equal'):
    """One --queries=all example as a string (newline included), drawn from rng: --chains chains of
    --hops letters each (--lengths=random: each of the chains * hops letters joins a chain drawn
    uniformly, every chain keeping at least one), every letter queried once in a shuffled order,
    '?' + letter + digit."""
    n = chains * hops
    letters = rng.sample(LETTERS, n)
    digits = rng.sample(DIGITS, chains)
    sizes = [hops] * chains
    while lengths == 'random':
        member = [rng.randrange(chains) for _ in range(n)]
        sizes = [member.count(c) for c in range(chains)]
        if min(sizes) > 0:
            break
    assignments, answers = [], {}
    for c, digit in enumerate(digits):
        start = sum(sizes[:c])  # the letters are in a random order: chain c takes the next sizes[c]
        chain = letters[start:start + sizes[c]] + [digit]
        assignments += [f"{a}={b}" for a, b in zip(chain, chain[1:])]
        answers.update((a, (digit, sizes[c] - i)) for i, a in enumerate(chain[:-1]))
    rng.shuffle(assignments)
    queries = rng.sample(letters, n)
    example = ';'.join(assignments) + ''.join(f"?{q}{answers[q][0]}" for q in queries) + '\n'
    assert solve(example) == [answers[q] for q in queries], example
    return example


def solve(example):
    """[(answer digit, lookups taken)] for each query of an example, in the line's order (its line,
    either format, with or without the answers): follow the assignments from each queried letter
    (the character after each '?') until a digit. The letter directly assigned a digit takes 1
    lookup, its predecessor 2, and so on. ValueError for a line that is not a well-formed example
    (a missing or repeated left side, a loop, no query)."""
    body, *queries = example.rstrip('\n').split('?')
    table = {}
    for assignment in body.split(';'):
        left, eq, right = assignment.partition('=')
        if not eq or left in table:
            raise ValueError(f"not an example: {example!r}")
        table[left] = right
    if not queries or not all(queries):
        raise ValueError(f"not an example (a '?' without a letter): {example!r}")
    out = []
    for query in queries:
        value, steps = query[0], 0
        while not (len(value) == 1 and value in DIGITS):
            if value not in table or steps > len(table):
                raise ValueError(f"the query {query[0]!r} of {example!r} does not lead to a digit")
            value, steps = table[value], steps + 1
        out.append((value, steps))
    return out


def make_split(rng, n_examples, hops, chains, min_hops, queries='one', lengths='equal'):
    """n_examples examples as one string."""
    if queries == 'all':
        return ''.join(make_example_all(rng, hops, chains, lengths) for _ in range(n_examples))
    return ''.join(make_example(rng, hops, chains, min_hops) for _ in range(n_examples))


def prepare(out_dir, hops=2, chains=2, min_hops=None, n_train=100_000, n_val=2_000, seed=1,
            queries='all', lengths='equal'):
    """Make both splits from one seeded generator (train first, then val) and write them. Returns
    the meta written (without the file hashes)."""
    min_hops = hops if min_hops is None else min_hops
    check_knobs(hops, chains, min_hops, queries, lengths)
    for flag, n in (('--n_train', n_train), ('--n_val', n_val)):
        if n < 1:
            raise PrepareError(f"{flag}={n}: needs at least one example")
    rng = random.Random(seed)
    train, val = (make_split(rng, n, hops, chains, min_hops, queries, lengths)
                  for n in (n_train, n_val))
    example_len, answer_offsets = layout(hops, chains, queries)
    meta = {'vocab_size': len(ITOS), 'itos': ITOS, 'tokenizer': 'char', 'task': 'chains',
            'queries': queries, 'example_len': example_len, 'answer_offsets': answer_offsets,
            'hops': hops, 'min_hops': min_hops, 'chains': chains, 'seed': seed,
            'n_train': n_train, 'n_val': n_val, 'lengths': lengths}
    if queries == 'one':  # the single-query layout's older key, which its readers know
        meta['answer_offset'] = answer_offsets[0]
    write_dataset(out_dir, [STOI[c] for c in train], [STOI[c] for c in val], meta)
    return meta


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--hops', type=int, default=2,
                        help="lookups from the queried letter to its digit")
    parser.add_argument('--min_hops', type=int, default=None,
                        help='unset: every example takes --hops lookups; else min_hops..hops each')
    parser.add_argument('--chains', type=int, default=2,
                        help="chains per example: the query's and the distractors")
    parser.add_argument('--queries', choices=QUERIES, default=QUERIES[0],
                        help="all: every letter queried once per example ('?a5'), chains x hops "
                        "answers at 1..hops lookups; one: the chain head alone ('?a=5')")
    parser.add_argument('--lengths', choices=LENGTHS, default=LENGTHS[0],
                        help="with --queries=all: equal (each chain --hops letters) or random "
                        "(each letter's chain drawn: the answers seen tell nothing of the next)")
    parser.add_argument('--n_train', type=int, default=100_000, help='training examples')
    parser.add_argument('--n_val', type=int, default=2_000, help='validation examples')
    parser.add_argument('--seed', type=int, default=1,
                        help='the examples drawn (the same seed, the same bytes)')
    parser.add_argument('--out_dir', default=HERE, help='where train.bin, val.bin and meta.json go')
    return parser


def main(argv=None):
    args = get_parser().parse_args(argv)
    try:
        meta = prepare(args.out_dir, args.hops, args.chains, args.min_hops, args.n_train,
                       args.n_val, args.seed, args.queries, args.lengths)
    except PrepareError as e:
        sys.exit(f"prepare.py: error: {e}")
    L = meta['example_len']
    hops = (f"{meta['hops']} hops" if meta['min_hops'] == meta['hops']
            else f"{meta['min_hops']}..{meta['hops']} hops")
    offsets = meta['answer_offsets']
    where = (f"answer at offset {offsets[0]}" if len(offsets) == 1
             else f"{len(offsets)} answers at offsets {offsets[0]}..{offsets[-1]}")
    if meta['lengths'] == 'random':
        hops = f"chains of random length ({meta['hops']} letters each on average)"
    print(f"chains: {hops}, {meta['chains']} chains, queries {meta['queries']}, seed "
          f"{meta['seed']}: {meta['n_train']:,} train / {meta['n_val']:,} val examples of {L} "
          f"characters ({where}), vocab {meta['vocab_size']} -> {args.out_dir}")
    print(f"expected: {meta['n_train'] * L:,} train / {meta['n_val'] * L:,} val tokens; a model "
          f"that cannot follow the chain answers at most 1/{meta['chains']} = "
          f"{1 / meta['chains']:.3f} right")


if __name__ == '__main__':
    main()
