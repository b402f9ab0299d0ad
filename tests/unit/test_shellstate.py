"""envs/shellstate.py: the files a command reads and writes, and each turn's state distance
(the turns since the episode last wrote a file the command reads)."""

import pytest

from envs.config import FileopsConfig
from envs.fileops import FileopsSolver, generate_fileops
from envs.shellstate import command_files, state_distances


@pytest.mark.parametrize(
    "command, reads, writes",
    [
        ("sort input.txt > a.txt", {"input.txt"}, {"a.txt"}),
        ("tr a-z A-Z < a.txt > b.txt", {"a.txt"}, {"b.txt"}),
        ("echo 'x-1' >> log.txt", set(), {"log.txt"}),
        ("wc -l < log.txt", {"log.txt"}, set()),
        ("grep e b.txt | head -n 1", {"b.txt"}, set()),
        ("mv inbox/a.txt archive/", {"inbox/a.txt"}, {"archive", "inbox/a.txt"}),
        ("mkdir -p notes && cp ./x.txt notes/y.txt", {"x.txt"}, {"notes", "notes/y.txt"}),
        ("sed -i 's/a - b/a + b/' calc.py", {"calc.py"}, {"calc.py"}),
        ("ls archive | paste -sd, -", {"archive"}, set()),
        ("cat x 2>/dev/null; echo hi | tee out.txt", {"x"}, {"out.txt"}),
        ("echo 'unterminated", set(), set()),  # not splittable: touches nothing
        ("LANG=C sort $FILE > sorted.txt", set(), {"sorted.txt"}),
    ],
)
def test_command_files(command, reads, writes):
    assert command_files(command) == (reads, writes)


def test_state_distances_count_turns_since_the_write_a_command_reads():
    commands = [
        "sort input.txt > a.txt",  # reads only a starting file
        "cat notes.txt",  # a distractor: never written
        "head -n 2 a.txt > b.txt",  # a.txt: written 2 turns back
        "mkdir archive",
        "mv b.txt archive/",  # b.txt: 2 turns back
        "ls archive",  # archive: written by the turn before (the mv into it)
        "submit 3",
    ]
    assert state_distances(commands) == [None, None, 2, None, 2, 1, None]


def test_the_fileops_solver_reads_what_it_wrote():
    for task in generate_fileops(FileopsConfig(num_tasks=12, seed=5)):
        d = state_distances(FileopsSolver(task).commands)
        assert d[-1] is not None and d[-1] >= 1, (task.instruction, d)  # the answer's read
