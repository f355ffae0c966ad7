"""lab/report.py: the markdown tables, CSV files and figures every tool writes (each written beside its destination
and renamed over it, never through a planted link), and the one-line error that names the command as it is typed."""

import glob
import os

import pytest

import plot_norms
import sample
import train
from conftest import ROOT
from lab import atlas, diagnose, matched_depth, norm_course, report


def test_markdown_table_is_the_header_the_separator_and_one_line_per_row():
    text = report.markdown(['a', 'b c'], [['1', ''], ['x', 2.5]])
    assert text == '| a | b c |\n|---|---|\n| 1 |  |\n| x | 2.5 |'


def table_blocks(path):
    """The runs of lines that start with '|' in a markdown file: its tables."""
    blocks, block = [], []
    with open(path, encoding='utf-8') as f:
        for line in f.read().split('\n') + ['']:
            if line.startswith('|'):
                block.append(line)
            elif block:
                blocks.append(block)
                block = []
    return blocks


def test_markdown_rebuilds_every_committed_table_byte_for_byte():
    """The committed tables under figures/ were written by the builders markdown replaced: it writes them again
    the same, so a refreshed figure folder changes only where the numbers do."""
    blocks = [b for path in glob.glob(os.path.join(ROOT, 'figures', '**', '*.md'), recursive=True)
              for b in table_blocks(path)]
    assert len(blocks) >= 10
    for block in blocks:
        cells = [line[2:-2].split(' | ') for line in block]
        assert report.markdown(cells[0], cells[2:]) == '\n'.join(block)


def test_write_csv_quotes_as_the_csv_module_does_and_ends_lines_with_crlf(tmp_path):
    path = tmp_path / 'a' / 't.csv'  # its folder does not exist yet
    report.write_csv(str(path), [['name', 'value'], ['x, y', 1], ['say "hi"', 2.5]])
    assert path.read_bytes() == b'name,value\r\n"x, y",1\r\n"say ""hi""",2.5\r\n'
    assert os.listdir(path.parent) == ['t.csv']  # no .tmp left


def test_write_csv_can_end_lines_with_lf_as_matched_depth_csv_always_has(tmp_path):
    report.write_csv(str(tmp_path / 't.csv'), [['a', 'b'], ['1', '2']], lineterminator='\n')
    assert (tmp_path / 't.csv').read_bytes() == b'a,b\n1,2\n'


def test_write_csv_and_write_text_replace_a_planted_link_without_writing_through_it(tmp_path):
    victim = tmp_path / 'victim'
    victim.write_text('precious\n')
    writers = {'t.csv': lambda p: report.write_csv(p, [['a']]), 't.md': lambda p: report.write_text(p, 'x')}
    for name, write in writers.items():
        os.symlink(victim, tmp_path / name)
        write(str(tmp_path / name))
        assert not os.path.islink(tmp_path / name) and victim.read_text() == 'precious\n'


def small_figure():
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([1, 2, 3], [1, 4, 9])
    return plt, fig


def test_save_figure_writes_a_png_and_an_svg_beside_it_and_closes_the_figure(tmp_path):
    plt, fig = small_figure()
    path = str(tmp_path / 'new' / 'fig.png')
    assert report.save_figure(fig, path, dpi=50) == path
    assert (tmp_path / 'new' / 'fig.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert b'<svg' in (tmp_path / 'new' / 'fig.svg').read_bytes()
    assert sorted(os.listdir(tmp_path / 'new')) == ['fig.png', 'fig.svg']  # no .tmp left
    assert not plt.fignum_exists(fig.number)


def test_save_figure_writes_the_same_bytes_for_the_same_figure_so_a_rebuild_shows_no_change(tmp_path):
    for name in ('a', 'b'):
        report.save_figure(small_figure()[1], str(tmp_path / name / 'fig.png'), dpi=50)
    for ext in ('png', 'svg'):
        assert (tmp_path / 'a' / f'fig.{ext}').read_bytes() == (tmp_path / 'b' / f'fig.{ext}').read_bytes()


def test_save_figure_replaces_planted_links_and_leaves_their_targets_alone(tmp_path):
    victim = tmp_path / 'victim'
    victim.write_text('precious\n')
    for name in ('fig.png', 'fig.svg'):
        os.symlink(victim, tmp_path / name)
    _, fig = small_figure()
    report.save_figure(fig, str(tmp_path / 'fig.png'), dpi=50)
    assert victim.read_text() == 'precious\n'
    assert not os.path.islink(tmp_path / 'fig.png') and not os.path.islink(tmp_path / 'fig.svg')
    assert (tmp_path / 'fig.png').stat().st_size > 100 and (tmp_path / 'fig.svg').stat().st_size > 100


def test_save_figure_that_fails_leaves_the_old_file_whole(tmp_path):
    (tmp_path / 'fig.png').write_bytes(b'the old figure')
    _, fig = small_figure()

    def broken(*args, **kwargs):
        raise RuntimeError('the disk is full')
    fig.savefig = broken
    with pytest.raises(RuntimeError):
        report.save_figure(fig, str(tmp_path / 'fig.png'))
    assert (tmp_path / 'fig.png').read_bytes() == b'the old figure' and os.listdir(tmp_path) == ['fig.png']


@pytest.mark.parametrize('get_parser, prog', [
    (train.get_parser, 'train.py'), (sample.get_parser, 'sample.py'), (plot_norms.get_parser, 'plot_norms.py'),
    (atlas.get_parser, 'python -m lab.atlas'), (norm_course.get_parser, 'python -m lab.norm_course'),
    (matched_depth.get_parser, 'python -m lab.matched_depth'), (diagnose.get_parser, 'python -m lab.diagnose')])
def test_a_parser_error_is_one_line_naming_the_command_as_it_is_typed(get_parser, prog):
    with pytest.raises(SystemExit) as e:
        get_parser().parse_args(['some_run', '--no_such_flag'])
    message = str(e.value.code)
    assert message.startswith(f"{prog}: error: ") and '--no_such_flag' in message and '\n' not in message


def test_the_checks_before_the_work_name_the_flag_in_one_line(tmp_path):
    p = report.tool_parser('python -m lab.x', 'a tool')
    with pytest.raises(SystemExit) as e:
        report.at_least(p, '--max_windows', 1, 4, 'two windows in the reporting half')
    assert e.value.code == ('python -m lab.x: error: --max_windows=1 must be at least 4 '
                            '(two windows in the reporting half)')
    report.at_least(p, '--max_windows', None, 4)  # not given: nothing to check
    with pytest.raises(SystemExit) as e:
        report.check_destination(p, str(tmp_path), '--fig_dir')
    assert str(e.value.code).startswith(f'python -m lab.x: error: --fig_dir: {tmp_path} is a folder')
    with pytest.raises(SystemExit) as e:
        report.split_flags(p, "--max_iters='4")
    assert str(e.value.code).startswith('python -m lab.x: error: --train_args="--max_iters=\'4": ')
    assert report.split_flags(p, "--max_iters=4 --init='gpt2'") == ['--max_iters=4', '--init=gpt2']
