"""
What every prepare script shares: reading a text, downloading a file from the first source that works, and
writing a dataset folder (train.bin, val.bin and meta.pkl) so that it is never seen half-written.

This module imports nothing of data/ itself, so every prepare script can import it and none imports another's
helpers through the package.
"""

import http.client
import os
import pickle
import sys
import time
import urllib.error
import urllib.request

import numpy as np

FILES = ('train.bin', 'val.bin', 'meta.pkl')
# Some hosts refuse Python's own "Python-urllib/3.x" (the WikiText author's mirror answers it with 403).
USER_AGENT = 'Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0 (looped prepare script)'


class PrepareError(Exception):
    """A prepare script's failure, with a one-line explanation for the user."""


def read_text(path):
    """The UTF-8 text of a file; PrepareError in one line for a missing, unreadable or binary file."""
    try:
        with open(path, encoding='utf-8') as f:
            return f.read()
    except UnicodeDecodeError:
        raise PrepareError(f"{path} is not UTF-8 text (a binary file?)") from None
    except OSError as e:
        raise PrepareError(f"cannot read {path} ({e.strerror})") from None


def open_new(path):
    """A fresh file at path, opened for binary writing. Whatever was there is unlinked first (a symlink planted
    there is removed, never followed), and the new file is created exclusively and without following links, so
    a writer can never be turned into overwriting some other file."""
    if os.path.lexists(path):
        os.remove(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, 'O_NOFOLLOW', 0) | getattr(os, 'O_BINARY', 0)
    return os.fdopen(os.open(path, flags, 0o644), 'wb')


def _fetch(url, path, timeout):
    """Stream url into path, printing bytes, MB/s and ETA; raises on any HTTP, network or length problem."""
    request = urllib.request.Request(url, headers={'User-Agent': USER_AGENT})
    with urllib.request.urlopen(request, timeout=timeout) as r, open_new(path) as f:  # redirects are followed
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
                print(f"\r  {done / 1e6:.1f}{of} MB, {rate / 1e6:.1f} MB/s{eta}   ", end="", flush=True)
                shown = now
        print()
        if total and done != total:
            raise PrepareError(f"the connection closed after {done:,} of {total:,} bytes")


def download(urls, dest, verify, timeout=30):
    """Keep as dest the first of urls whose file passes verify(path) (which raises PrepareError with the reason
    when it does not). Each source is streamed to dest + '.tmp', checked, and only then renamed to dest, so
    nothing half-downloaded is ever taken for the file. Any failure is one line, and the next source is tried.
    Returns the url used; PrepareError listing every source and its reason when none works."""
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
        except (OSError, http.client.HTTPException, PrepareError) as e:  # timeouts, refusals, cut connections
            why = str(getattr(e, 'reason', None) or e) or type(e).__name__
        if os.path.lexists(tmp):
            os.remove(tmp)
        print(f"  failed: {why}; trying the next source" if url != urls[-1] else f"  failed: {why}", flush=True)
        failures.append(f"{url} ({why})")
    raise PrepareError("no source worked: " + '; '.join(failures))


def write_dataset(out_dir, train_ids, val_ids, meta):
    """Write train.bin, val.bin (uint16) and meta.pkl into out_dir. Everything is checked first, then all three
    files are written beside the old ones (*.tmp) and only then renamed into place: a failure at any point (a
    vocabulary too large for uint16, a full disk, a read-only folder) leaves a prepared dataset as it was."""
    if meta['vocab_size'] > 65536:
        raise PrepareError(f"a vocabulary of {meta['vocab_size']:,} does not fit uint16 token ids (at most 65,536)")
    arrays = {'train.bin': np.asarray(train_ids), 'val.bin': np.asarray(val_ids)}
    for name, ids in arrays.items():
        if ids.size == 0 or ids.min() < 0 or ids.max() >= meta['vocab_size']:
            raise PrepareError(f"{name}: token ids must be in 0..{meta['vocab_size'] - 1} and there must be some")
    written = []
    try:
        os.makedirs(out_dir, exist_ok=True)
        for name, ids in arrays.items():
            written.append(os.path.join(out_dir, name + '.tmp'))
            with open_new(written[-1]) as f:
                ids.astype(np.uint16).tofile(f)
        written.append(os.path.join(out_dir, 'meta.pkl.tmp'))
        with open_new(written[-1]) as f:
            pickle.dump(meta, f)
    except OSError as e:
        for tmp in written:
            if os.path.lexists(tmp):
                os.remove(tmp)
        raise PrepareError(f"cannot write to {out_dir} ({e.strerror}); nothing there was changed") from None
    for tmp in written:
        os.replace(tmp, tmp[:-len('.tmp')])
