"""
What the prepare scripts and data/loader.py share: the project's error for bad input
(InputError), reading a text, downloading a file from the first source that works, and writing a
dataset folder so that it is never seen half-written, with a hash of each split that the loader
checks (so that a checkpoint and the data it is read with are known to be the same data).

A dataset folder holds train.bin and val.bin (uint16 token ids) and meta.json: the vocabulary, plus
the size and a hash of each .bin file. meta.json is written last, so a prepare interrupted between
its renames leaves .bin files that do not match it, which the loader refuses.

This module imports nothing of data/ itself, so every prepare script can import it and none imports
another's helpers through the package.
"""

import hashlib
import http.client
import json
import os
import time
import urllib.error
import urllib.request

import numpy as np

FILES = ('train.bin', 'val.bin', 'meta.json')
MAX_VOCAB = 65536  # uint16 token ids
# Some hosts refuse Python's own "Python-urllib/3.x" (the WikiText author's mirror answers it with
# 403).
USER_AGENT = ('Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0 '
              '(looped prepare script)')


class InputError(ValueError):
    """What a user gave cannot be used (a flag, a dataset, a run folder, a checkpoint, a device),
    or a run cannot go on with it (its loss diverged). The project's own checks raise it, and
    train.py prints it in one line; any other exception is a bug (the project's or a student's
    edit) and keeps its traceback."""


class PrepareError(InputError):
    """A prepare script's failure, with a one-line explanation for the user."""


def read_text(path):
    """The UTF-8 text of a file; PrepareError in one line for a missing, unreadable or binary
    file."""
    try:
        with open(path, encoding='utf-8') as f:
            return f.read()
    except UnicodeDecodeError:
        raise PrepareError(f"{path} is not UTF-8 text (a binary file?)") from None
    except OSError as e:
        raise PrepareError(f"cannot read {path} ({e.strerror})") from None


def open_new(path):
    """A fresh file at path, opened for binary writing. Whatever was there is unlinked first (a
    symlink planted there is removed, never followed), and the new file is created exclusively and
    without following links, so a writer can never be turned into overwriting some other file."""
    if os.path.lexists(path):
        os.remove(path)
    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, 'O_NOFOLLOW', 0)
             | getattr(os, 'O_BINARY', 0))
    return os.fdopen(os.open(path, flags, 0o644), 'wb')


def write_atomically(path, write):
    """Fill a fresh temporary file beside path with write(f), then rename it over path: a link
    planted at path (or at its temporary) is replaced, never followed, and a failure leaves whatever
    was at path as it was. Missing folders on the way to path are created (every writer in the
    repository comes through here)."""
    tmp = path + '.tmp'
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    try:
        with open_new(tmp) as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def check_writable(path):
    """Before long work whose result goes to path: ValueError in one line if path is a folder or its
    folder cannot take a new file (so the error comes first, not after the work)."""
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder; give a file name "
                         f"(for example {os.path.join(path, 'out.png')})")
    missing, folder = [], os.path.abspath(os.path.dirname(path) or '.')
    # folders the probe creates, removed again: a check leaves nothing behind
    while not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    # one per process: two workers started together do not collide
    probe = f"{path}.probe{os.getpid()}"
    try:
        # another process's check may remove a folder this one has just made
        for attempt in range(3):
            os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
            try:
                with open_new(probe):
                    break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"cannot write {path} ({e.strerror or e})") from None
    finally:
        for created in missing:  # deepest first
            try:
                os.rmdir(created)  # only an empty folder goes: one another process is using stays
            except OSError:
                pass


def _fetch(url, path, timeout):
    """Stream url into path, printing bytes, MB/s and ETA; raises on any HTTP, network or length
    problem."""
    request = urllib.request.Request(url, headers={'User-Agent': USER_AGENT})
    # redirects are followed
    with urllib.request.urlopen(request, timeout=timeout) as r, open_new(path) as f:
        total = int(r.headers.get('Content-Length') or 0)
        done, t0, shown = 0, time.time(), 0.0
        while chunk := r.read(1 << 20):
            f.write(chunk)
            done += len(chunk)
            now = time.time()
            if now - shown > 0.5 or (total and done == total):
                rate = done / max(now - t0, 1e-6)
                eta = f", ETA {(total - done) / rate:.0f} s" if total else ''
                of = f" of {total / 1e6:.1f}" if total else ''
                print(f"\r  {done / 1e6:.1f}{of} MB, {rate / 1e6:.1f} MB/s{eta}   ", end="",
                      flush=True)
                shown = now
        print()
        if total and done != total:
            raise PrepareError(f"the connection closed after {done:,} of {total:,} bytes")


def download(urls, dest, verify, timeout=30):
    """Keep as dest the first of urls whose file passes verify(path) (which raises PrepareError with
    the reason when it does not). Each source is streamed to dest + '.tmp', checked, and only then
    renamed to dest, so nothing half-downloaded is ever taken for the file. Any failure is one line,
    and the next source is tried. Returns the url used; PrepareError listing every source and its
    reason when none works."""
    tmp, failures = dest + '.tmp', []
    for url in urls:
        print(f"downloading {url}", flush=True)
        try:
            _fetch(url, tmp, timeout)
            verify(tmp)
            os.replace(tmp, dest)
            return url
        except urllib.error.HTTPError as e:  # before OSError: an HTTPError is one
            why = f"HTTP {e.code} {e.reason}"
        # timeouts, refusals, cut connections
        except (OSError, http.client.HTTPException, PrepareError) as e:
            why = str(getattr(e, 'reason', None) or e) or type(e).__name__
        if os.path.lexists(tmp):
            os.remove(tmp)
        print(f"  failed: {why}; trying the next source" if url != urls[-1] else f"  failed: {why}",
              flush=True)
        failures.append(f"{url} ({why})")
    raise PrepareError("no source worked: " + '; '.join(failures))


def file_hash(data):
    """The size of a file's bytes and a SHA-256 of its first and last megabyte: cheap for a 200 MB
    split, and any re-preparation changes it (ids shift, the length changes, or both)."""
    return [len(data), hashlib.sha256(bytes(data[:1 << 20]) + bytes(data[-(1 << 20):])).hexdigest()]


def vocab_hash(meta):
    """A hash of the vocabulary itself (everything in meta but the file hashes)."""
    vocab = {k: v for k, v in meta.items() if k != 'files'}
    return hashlib.sha256(
        json.dumps(vocab, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def write_dataset(out_dir, train_ids, val_ids, meta):
    """Write train.bin, val.bin (uint16) and meta.json into out_dir. Everything is checked first,
    then all three files are written beside the old ones (*.tmp) and renamed into place, meta.json
    (which holds the other two's hashes) last: a failure at any point (a vocabulary too large for
    uint16, a full disk, a read-only folder, a kill) leaves either the old dataset or one that
    read_dataset refuses, never a mix that looks whole."""
    if not 1 <= meta['vocab_size'] <= MAX_VOCAB:
        raise PrepareError(f"a vocabulary of {meta['vocab_size']:,} does not fit uint16 token ids "
                           "(at most 65,536)")
    arrays = {'train.bin': np.asarray(train_ids), 'val.bin': np.asarray(val_ids)}
    for name, ids in arrays.items():
        if ids.size == 0 or ids.min() < 0 or ids.max() >= meta['vocab_size']:
            raise PrepareError(f"{name}: token ids must be in 0..{meta['vocab_size'] - 1} and "
                               "there must be some")
    blobs = {name: ids.astype(np.uint16).tobytes() for name, ids in arrays.items()}
    blobs['meta.json'] = json.dumps({**meta, 'files': {n: file_hash(b) for n, b in blobs.items()}},
                                    ensure_ascii=False).encode()
    try:
        os.makedirs(out_dir, exist_ok=True)
        for name, blob in blobs.items():
            with open_new(os.path.join(out_dir, name + '.tmp')) as f:
                f.write(blob)
        # meta.json last: until it lands, the new .bin files do not match the meta present
        for name in blobs:
            os.replace(os.path.join(out_dir, name + '.tmp'), os.path.join(out_dir, name))
    except OSError as e:
        raise PrepareError(f"cannot write to {out_dir} ({e.strerror or e}); nothing there was "
                           "changed") from None
    finally:  # an interrupted or failed prepare leaves no .tmp behind
        for name in blobs:
            if os.path.lexists(os.path.join(out_dir, name + '.tmp')):
                os.remove(os.path.join(out_dir, name + '.tmp'))
    # an older prepare's vocabulary: meta.json replaces it
    if os.path.lexists(os.path.join(out_dir, 'meta.pkl')):
        os.remove(os.path.join(out_dir, 'meta.pkl'))
