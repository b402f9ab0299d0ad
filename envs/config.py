"""Configs of the environment side: one frozen dataclass per shell backend, the terminal env (and
its reward shaping per task family) and the textops task family, plus `ShellConfig`, which
picks a backend.

Imports no JAX (and not the e2b SDK), so configs validate instantly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rl import validate
from rl.data.trajectory import TRIAL_REWARDS  # the trajectory records which one it ran under

TEXTOPS_OPS = ("reverse", "upper", "sort", "count", "write_read")
STRING_OPS = ("reverse", "upper", "sort", "count")
"""The textops operations on a word that the utility grammar writes commands for."""
TRANSFORM_OPS = ("reverse", "upper", "sort")
"""The string-to-string ones: a pipeline stage turns the word into the answer
(`envs.textops.TRANSFORMS`)."""
SHELL_BACKENDS = ("local", "e2b", "simulated")

DEFAULT_OBSERVATION_TEMPLATE = "<returncode>{exit_code}</returncode>\n<output>\n{output}\n</output>"

DEFAULT_PROMPT_TEMPLATE = """{instruction}

You work in a Linux shell. Reply with a short thought and EXACTLY ONE bash code block:

```bash
<command>
```

Each command runs in a fresh `bash -c` in the task's working directory: only the filesystem \
persists between commands (cd and variables do not). You see the return code and the output.
When you are done, submit in one of two ways:
- a block whose command is `submit <answer>`: the text after `submit ` is your answer, taken \
literally (it is not run);
- a block whose first line is `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`, followed by \
commands that print the final output (for example `git diff`)."""

DEFAULT_TRIAL_FEEDBACK_TEMPLATE = (
    "Attempt {trial} of {trials} failed: {outcome}.{verdict} The workspace is back in its "
    "starting state. Try again."
)
TRIAL_FEEDBACK_FIELDS = ("trial", "trials", "outcome", "verdict", "submission")

DEFAULT_FORMAT_ERROR_TEMPLATE = """Format error: {reason}

Reply with EXACTLY ONE bash code block, like this:

```bash
<command>
```

To finish, use a block whose command is `submit <answer>`, or whose first line is \
`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`."""


@dataclass(frozen=True)
class LocalShellConfig:
    """Real bash on this machine, in a throwaway workspace (the embedded default)."""

    workspace_root: str | None = None
    """Directory that holds the per-episode workspaces; None: the system temp directory."""
    user: str = "nobody"
    """Account the commands run as when simloop runs as root (root ignores RLIMIT_NPROC) and
    `uid_base` is 0; ignored otherwise: commands then run as the current user."""
    uid_base: int = 60000
    """As root, each shell runs its commands as its own uid from `uid_base` ..
    `uid_base + uid_count - 1` (held with a lock file for the shell's life, across processes;
    uids of existing accounts are skipped), so concurrent episodes cannot read each other's
    files and RLIMIT_NPROC caps each episode alone. 0: every shell runs as `user`."""
    uid_count: int = 1024
    """How many uids from `uid_base` (at most this many concurrent shells per machine)."""
    tmpfs_bytes: int = 64 * 2**20
    """Size cap of each episode's private `/tmp`, `/var/tmp` and `/dev/shm` (tmpfs, gone with
    the command) where a mount namespace works."""
    disk_bytes: int = 512 * 2**20
    """Disk quota of an episode: its workspace, home and TMPDIR live on a tmpfs of this size,
    where a mount namespace works. A command that fills it while running is killed and its
    observation says so. A tmpfs is memory as far as it is used: concurrent episodes times
    this (plus 3 x `tmpfs_bytes`) is what a runaway batch could take."""
    isolate_network: bool = True
    """Run commands in a fresh network namespace (`unshare -n`) where that works."""
    visible_paths: list[str] = field(default_factory=list)
    """Host folders the commands must see, read-only, even where the episode's private tmp
    folders would hide them (a checkout or a virtualenv under /tmp: what a harness runs with).
    Folders that do not exist are left out."""
    max_output_bytes: int = 65_536
    """Output kept per command (stdout and stderr merged); the middle of longer output is cut."""
    kill_after_output_bytes: int = 16 * 2**20
    """A command that prints more than this is killed (runaway output)."""
    cpu_time_s: int = 60
    """RLIMIT_CPU of each process, in CPU seconds."""
    memory_bytes: int = 4 * 2**30
    """RLIMIT_AS (address space) of each process."""
    file_size_bytes: int = 256 * 2**20
    """RLIMIT_FSIZE: largest file a command may write."""
    max_processes: int = 512
    """RLIMIT_NPROC of the command user; counts every process of that user on the machine, so
    concurrent shells running as the same user share it."""
    drain_grace_s: float = 0.5
    """After the command exits, how long to wait for background children that still hold its
    output pipe before they are killed."""
    setup_timeout_s: float = 120.0
    """Timeout of each task setup command."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for commands (the parent's environment is never passed)."""

    def __post_init__(self) -> None:
        validate.positive_int(
            self,
            "max_output_bytes",
            "kill_after_output_bytes",
            "cpu_time_s",
            "memory_bytes",
            "file_size_bytes",
            "max_processes",
            "uid_count",
            "tmpfs_bytes",
            "disk_bytes",
        )
        validate.positive(self, "drain_grace_s", "setup_timeout_s")
        base = self.uid_base
        validate.require(
            validate.is_int(base)
            and (base == 0 or (base >= 1000 and base + self.uid_count < 2**32 - 1)),
            self,
            "uid_base",
            "0 (off), or a uid >= 1000 with room for uid_count",
        )
        validate.require(
            self.kill_after_output_bytes >= self.max_output_bytes,
            self,
            "kill_after_output_bytes",
            f"at least max_output_bytes ({self.max_output_bytes})",
        )
        validate.text(self, "user", allowed="a name")
        validate.require(
            isinstance(self.env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()),
            self,
            "env",
            "a mapping of strings to strings",
        )


@dataclass(frozen=True)
class E2BConfig:
    """Cloud sandboxes from e2b (`AsyncSandbox`); the API key comes from the environment."""

    template: str = "base"
    """Sandbox template id or name."""
    sandbox_timeout_s: int = 900
    """Lifetime of a sandbox: e2b kills it after this even if simloop dies first."""
    api_key_env: str = "E2B_API_KEY"
    """Name of the environment variable holding the API key (never the key itself)."""
    workdir: str = "/home/user/workspace"
    """Working directory of every command; task files are uploaded relative to it."""
    user: str = "user"
    """Sandbox account the commands run as."""
    allow_internet_access: bool = True
    """Whether the sandbox may reach the internet."""
    creation_rate_per_s: float = 5.0
    """At most this many sandbox creations per second across all episodes of the process."""
    max_concurrent: int = 100
    """At most this many live sandboxes across all episodes of the process."""
    request_timeout_s: float = 30.0
    """Timeout of one API request (creation, upload, kill), on top of a command's own timeout."""
    retries: int = 3
    """Retries of idempotent calls (upload, kill, list) and of refused creations."""
    backoff_s: float = 0.5
    """First retry delay; doubles per retry, with jitter."""
    max_backoff_s: float = 8.0
    """Cap on one retry delay."""
    max_output_bytes: int = 65_536
    """Output kept per command; the middle of longer output is cut."""
    setup_timeout_s: float = 300.0
    """Timeout of each task setup command."""

    def __post_init__(self) -> None:
        validate.require(self.template, self, "template", "a template id or name")
        validate.require(self.api_key_env, self, "api_key_env", "a variable name")
        validate.require(
            isinstance(self.workdir, str) and self.workdir.startswith("/"),
            self,
            "workdir",
            "an absolute path",
        )
        validate.positive_int(self, "sandbox_timeout_s", "max_concurrent", "max_output_bytes")
        validate.positive(
            self,
            "creation_rate_per_s",
            "request_timeout_s",
            "backoff_s",
            "max_backoff_s",
            "setup_timeout_s",
        )
        validate.integer(self, "retries", low=0)


@dataclass(frozen=True)
class SimulatedShellConfig:
    """The learned terminal: observations come from the simulator server."""

    max_tokens: int = 1024
    """Cap on one observation, in tokens; keep it near the real observation length distribution
    (`envs.fidelity.suggest_max_tokens`) so a runaway (no end-of-turn) costs little and is
    counted as `cap_hit`."""
    temperature: float = 1.0
    """Sampling temperature of the simulator."""
    request_timeout_s: float = 120.0
    """Timeout of one completion request."""
    max_context_tokens: int | None = None
    """Simulator context length (prompt + observation); oldest turns are dropped to fit.
    Needs a tokenizer; None: no limit."""
    max_prompt_tokens: int | None = None
    """The prompt's share of `max_context_tokens` (system, kept turns, the command): oldest
    turns go until the prompt fits it. None: all the context but `max_tokens`. Set it to let
    a rare long observation (a usage text) be written whole without changing which turns the
    simulator sees; `simloop train-sim` builds its examples with the same budget."""
    max_history_turns: int | None = None
    """Keep at most this many earlier (command, observation) pairs in the prompt; None: all."""
    seed: int | None = None
    """Base sampling seed (each turn adds its index); None: the server's randomness."""
    system_prompt: str | None = None
    """The simulator's instructions at the top of its prompt; None: the built-in
    `rl.data.sim_format.SIM_SYSTEM_PROMPT`. `simloop train-sim` renders its examples with the
    same value, so a simulator is served with the prompt it was trained on."""
    show_task: bool = True
    """Show the agent's task to the simulator (a hint for what the sandbox holds). Off, the
    simulator sees only the starting files and the commands, like a real terminal, and
    cannot learn to answer the task whatever the command."""
    repetition_max_line_share: float = 0.5
    """`repetition` when one line makes up more than this share of an output's lines..."""
    repetition_min_lines: int = 8
    """...and the output has at least this many lines."""
    repetition_min_compression: float = 0.08
    """`repetition` when zlib compresses an output of at least 512 bytes below this ratio."""
    sessions: bool = False
    """One persistent KV session per episode on the simulator server (`simloop serve`'s
    `/v1/sessions`): each turn appends only what its prompt adds to the session, and a prompt
    that departs from it (older turns dropped to fit the context) rewinds it to where they
    still agree. The prompts, and so the observations, are the stateless ones. A server
    without sessions (vLLM) gets stateless completions. `orchestrator.sessions: true` turns
    this on too."""
    session_compaction: dict = field(default_factory=dict)
    """How the server thins each simulator session's KV (`serving.compaction`:
    `{"mode": "markovian", "n_protect_turns": 2}` ...; empty: none). With compaction the whole
    history is sent and the server decides what the simulator still sees, instead of the
    `max_context_tokens` rule. Needs `sessions: true`."""
    workspace: bool = False
    """The simulator keeps the working directory itself (`rl.data.sim_format`'s workspace
    mode): each prompt shows the files as they are now and the command, with no history
    (each command runs in a fresh `bash -c`, so only the files carry over), and the simulator
    writes, after the observation, every file the command created, changed or removed. The
    shell applies what it wrote to the files the next prompt shows: the model writes the
    state, nothing is executed. `simloop train-sim` builds its examples the same way, from
    the real workspace after each command (`envs.workspace`). For small workspaces (task
    files), not repositories. Off: the prompt is the starting files and the session."""
    workspace_named_last: bool = False
    """Workspace mode: the files the command names (a path written in it as a whole word,
    `rl.data.sim_format.named_paths`) are listed last in the prompt, right before the
    command, instead of in the order they were written. A file written several turns ago
    then sits where the file just written would, so reading it back is the same lookup. A
    layout of the prompt only: the simulator still writes every observation and file, and
    the order of the files it keeps is unchanged. `simloop train-sim` renders its examples
    the same way; a simulator must be served with the value it was trained on
    (`sim-fileops` stages 1-10: false; from stage 11: true)."""
    workspace_named_absent: bool = False
    """Workspace mode: one line after the files lists the file names the command gives that
    are not in the working directory (`rl.data.sim_format.absent_names`: a word shaped like
    `name.ext` that is no file or directory there), e.g. `Not in the working directory: b.txt,
    c.txt` for `sort -r b.txt > c.txt` before `b.txt` exists. Whether a file a command reads
    exists is then read off the line before the command instead of searched for among the
    blocks (stage 13 answered such reads with silence, as if they had worked). Text matching
    only: the line says nothing of what the command does with the names; the simulator
    still writes every observation, error and file. Trained and served alike, as
    `workspace_named_last` (`sim-fileops` stages 1-13: false; from stage 14: true)."""
    replay_cache: bool = True
    """Workspace mode: train-sim and eval-sim keep each episode's replayed workspaces (the real
    files after each command, from running its commands again in bash) in a cache on this
    machine and read them from it the next time the same episode comes (`envs.workspace`'s
    `ReplayCache`: `$SIMLOOP_REPLAY_CACHE`, else `~/.cache/simloop/workspace-replays.sqlite`).
    Off: every run replays every episode."""

    def __post_init__(self) -> None:
        validate.positive_int(self, "max_tokens", "repetition_min_lines")
        validate.positive(self, "request_timeout_s")
        validate.number(self, "temperature", low=0)
        validate.positive_int(
            self, "max_context_tokens", "max_history_turns", "max_prompt_tokens", optional=True
        )
        validate.require(
            self.max_context_tokens is None or self.max_context_tokens > self.max_tokens,
            self,
            "max_context_tokens",
            f"greater than max_tokens ({self.max_tokens})",
        )
        context = self.max_context_tokens
        validate.require(
            self.max_prompt_tokens is None
            or (context is not None and self.max_prompt_tokens + self.max_tokens <= context),
            self,
            "max_prompt_tokens",
            "set only with max_context_tokens, and at most max_context_tokens - "
            f"max_tokens ({context} - {self.max_tokens})",
        )
        validate.integer(self, "seed", low=0, optional=True, allowed="None or int >= 0")
        validate.number(self, "repetition_max_line_share", low=0, high=1, low_open=True)
        validate.number(self, "repetition_min_compression", low=0, high=1, high_open=True)
        validate.boolean(
            self, "sessions", "workspace", "workspace_named_last", "workspace_named_absent"
        )
        validate.require(
            self.workspace or not self.workspace_named_absent,
            self,
            "workspace_named_absent",
            "false unless workspace is true (it is a line of the workspace prompt)",
        )
        validate.require(
            not (self.workspace and self.session_compaction),
            self,
            "workspace",
            "false with session_compaction (a workspace prompt holds no history to compact)",
        )
        compaction = self.session_compaction
        mode = compaction.get("mode", "none") if isinstance(compaction, dict) else None
        validate.require(
            mode is not None, self, "session_compaction", "a mapping of compaction settings"
        )
        validate.require(
            mode == "none" or self.sessions, self, "session_compaction", "only with sessions: true"
        )

    @property
    def prompt_budget(self) -> int | None:
        """The most tokens the simulator's prompt may have (whole oldest turns go to fit):
        `max_prompt_tokens`, else `max_context_tokens - max_tokens`; None without a context."""
        if self.max_context_tokens is None:
            return None
        if self.max_prompt_tokens is not None:
            return self.max_prompt_tokens
        return self.max_context_tokens - self.max_tokens

    def prompt_layout(self) -> dict[str, bool]:
        """How this shell lays out the simulator's prompt, in the flags a simulator must be
        served with as it was trained (`train-sim` records them beside its weights,
        `rl.data.sim_format.PROMPT_LAYOUT_FILE`; the servers' clients check them)."""
        return {
            "workspace": self.workspace,
            "workspace_named_last": self.workspace_named_last,
            "workspace_named_absent": self.workspace_named_absent,
        }

    @property
    def compacting(self) -> bool:
        """Whether the server, not the prompt renderer, bounds what the simulator sees."""
        return self.sessions and self.session_compaction.get("mode", "none") != "none"


@dataclass(frozen=True)
class ShellConfig:
    """Which shell backend episodes use, and the settings of each."""

    backend: str = "local"
    """`local` (real bash here), `e2b` (cloud sandboxes) or `simulated` (the learned terminal)."""
    local: LocalShellConfig = field(default_factory=LocalShellConfig)
    e2b: E2BConfig = field(default_factory=E2BConfig)
    simulated: SimulatedShellConfig = field(default_factory=SimulatedShellConfig)

    def __post_init__(self) -> None:
        validate.one_of(self, "backend", SHELL_BACKENDS)


SHAPED_FAMILIES = ("textops", "fileops", "swe")
"""The task families (`Task.family`) that `TerminalConfig.shaping` may name."""


@dataclass(frozen=True)
class ShapingConfig:
    """Reward shaping of one task family's episodes (`TerminalConfig.shaping`): terms added to
    the task's reward for training, and recorded apart from it (`Trajectory.task_reward`,
    `Trajectory.shaping`), so success, which only the task's reward decides, stays exact.
    Every weight is >= 0 and the term's sign is fixed: a bonus adds, a penalty subtracts. All
    weights 0 (the default): no shaping."""

    format_bonus: float = 0.0
    """Added once to an episode none of whose replies was malformed (no format error)."""
    turn_budget: int | None = None
    """Agent turns an episode may take before `per_turn_penalty` applies; None: no budget."""
    per_turn_penalty: float = 0.0
    """Subtracted per agent turn beyond `turn_budget` (needs one)."""
    per_call_penalty: float = 0.0
    """Subtracted per command sent to the shell: every well-formed reply but `submit <answer>`
    (which runs nothing), a marker submission's block included."""

    def __post_init__(self) -> None:
        for name in ("format_bonus", "per_turn_penalty", "per_call_penalty"):
            value = getattr(self, name)
            validate.require(
                validate.is_number(value) and math.isfinite(value) and value >= 0,
                self,
                name,
                "a finite number >= 0 (a bonus is added, a penalty subtracted)",
            )
        validate.positive_int(
            self, "turn_budget", optional=True, allowed="None or a positive integer"
        )
        validate.require(
            self.per_turn_penalty == 0 or self.turn_budget is not None,
            self,
            "per_turn_penalty",
            "0 unless turn_budget is set (the penalty counts the turns beyond it)",
        )

    @property
    def enabled(self) -> bool:
        """Whether any term can be non-zero."""
        turns = self.per_turn_penalty > 0 and self.turn_budget is not None
        return self.format_bonus > 0 or turns or self.per_call_penalty > 0


@dataclass(frozen=True)
class TerminalConfig:
    """The terminal env: action parsing, observation format and episode limits."""

    max_turns: int = 20
    """Agent turns per episode (format errors count); the episode ends after the last."""
    command_timeout_s: float = 30.0
    """Timeout of each command."""
    max_observation_chars: int = 10_000
    """Output characters shown per observation; the middle of longer output is cut."""
    max_total_observation_chars: int = 200_000
    """The episode ends once the observations shown add up to more than this."""
    max_format_errors: int = 5
    """The episode ends after this many malformed replies."""
    observation_template: str = DEFAULT_OBSERVATION_TEMPLATE
    """How an observation is shown to the agent; `{exit_code}` and `{output}` are filled in."""
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    """The first user message; `{instruction}` is the task's instruction."""
    format_error_template: str = DEFAULT_FORMAT_ERROR_TEMPLATE
    """Shown after a malformed reply; `{reason}` says what was wrong."""
    trials: int = 1
    """Attempts per episode. A trial ends on a submission, its turn limit, its wall-clock
    limit or too many format errors; a failed one resets the workspace to its identical
    starting state, appends `trial_feedback_template` to the agent's context (which it keeps)
    and starts the next. The episode ends on the first success or after the last trial."""
    turns_per_trial: int | None = None
    """Agent turns per trial (None: `max_turns`). `max_turns` still bounds the episode."""
    trial_timeout_s: float | None = None
    """Wall-clock seconds per trial, checked after each agent turn (None: no limit)."""
    trial_feedback_template: str = DEFAULT_TRIAL_FEEDBACK_TEMPLATE
    """The user message after a failed trial. Fields: `{trial}` (1-based) and `{trials}`,
    `{outcome}` (why it ended: a wrong answer, the turn limit, ...), `{verdict}` (the task's
    checker explaining its decision, never the reference answer; empty when the task has
    none) and `{submission}` (what the agent submitted, empty if nothing)."""
    trial_reward: str = "first_success"
    """`first_success`: the episode's reward is the successful trial's reward times
    `trial_discount` per earlier trial (0 without a success). `per_trial`: each trial is
    scored and trained on its own (advantages per trial index across the group); the episode's
    reward is its last trial's."""
    trial_discount: float = 0.6
    """`first_success`: the factor per extra trial (LaMer uses 0.6)."""
    shaping: dict[str, ShapingConfig] = field(default_factory=dict)
    """Reward shaping per task family (`SHAPED_FAMILIES`), e.g. `{fileops: {format_bonus:
    0.1, turn_budget: 4, per_turn_penalty: 0.05}}`; a family not named is not shaped, and
    empty (the default) is off. The terms are added to the episode's reward once it ends (the
    whole episode's, over all its trials) and recorded apart from the task's reward, which
    alone decides success (`envs.terminal`)."""

    def __post_init__(self) -> None:
        validate.positive_int(
            self,
            "max_turns",
            "max_observation_chars",
            "max_total_observation_chars",
            "max_format_errors",
            "trials",
        )
        validate.positive(self, "command_timeout_s")
        validate.integer(
            self, "turns_per_trial", low=1, optional=True, allowed="None or an integer >= 1"
        )
        validate.positive(
            self, "trial_timeout_s", optional=True, allowed="None or a number of seconds > 0"
        )
        validate.one_of(self, "trial_reward", TRIAL_REWARDS)
        validate.number(self, "trial_discount", low=0, high=1, low_open=True)
        self._validate_shaping()
        template = self.trial_feedback_template
        ok = isinstance(template, str)
        if ok:
            try:
                template.format(**{k: "" for k in TRIAL_FEEDBACK_FIELDS})
            except (KeyError, IndexError, ValueError):
                ok = False
        fields = ", ".join("{" + k + "}" for k in TRIAL_FEEDBACK_FIELDS)
        validate.require(
            ok, self, "trial_feedback_template", f"a string whose only fields are {fields}"
        )
        for name, keys in (
            ("observation_template", ("{output}", "{exit_code}")),
            ("prompt_template", ("{instruction}",)),
            ("format_error_template", ("{reason}",)),
        ):
            value = getattr(self, name)
            validate.require(
                isinstance(value, str) and all(k in value for k in keys),
                self,
                name,
                f"a string containing {' and '.join(keys)}",
            )

    def _validate_shaping(self) -> None:
        shaping = self.shaping
        validate.require(
            isinstance(shaping, dict), self, "shaping", "a mapping from task families to shaping"
        )
        for family, terms in shaping.items():
            validate.require(
                family in SHAPED_FAMILIES,
                self,
                "shaping",
                f"a task family as key, one of {list(SHAPED_FAMILIES)}",
                value=family,
            )
            validate.require(
                isinstance(terms, ShapingConfig),
                self,
                f"shaping.{family}",
                "a ShapingConfig (in YAML, a mapping of its fields)",
                value=terms,
            )
        shaped = any(terms.enabled for terms in shaping.values())
        validate.require(
            not (shaped and self.trials > 1 and self.trial_reward == "per_trial"),
            self,
            "shaping",
            "off with trials > 1 and trial_reward per_trial: shaping is the episode's, and "
            "per-trial advantages read each trial's task reward",
            value=dict(shaping),
        )


FILEOPS_KINDS = ("chain", "append", "move", "fanout")
FILEOPS_DRILL_KINDS = ("read", "lookup")
"""Kinds for simulator training data, never drawn unless named (`FileopsConfig.kinds`)."""
FILEOPS_DEEP_KINDS = ("relay",)
"""Kinds of six to eight commands, never drawn unless named (`FileopsConfig.kinds`): adding
them to the defaults would change every seeded collection drawn from the four."""
FILEOPS_WORDS = ("fixed", "random", "mixed")


@dataclass(frozen=True)
class FileopsConfig:
    """The seeded `fileops` task family (envs/fileops.py): workspace tasks of 3-8 commands
    whose later commands read what earlier ones wrote."""

    num_tasks: int = 64
    """How many tasks to generate."""
    seed: int = 0
    """Generator seed: the same seed gives the same tasks."""
    kinds: list[str] = field(default_factory=lambda: list(FILEOPS_KINDS))
    """Which kinds to draw from: `FILEOPS_KINDS`, the deep `relay` (`FILEOPS_DEEP_KINDS`: five
    or six transformations in a row, turns 6-8), and the drills `read` (one file, one
    command that reads it: a copying drill for a simulator, one command long) and `lookup`
    (one numbered file, one `grep` for a word's line: a find-by-content drill). A kind listed
    twice is drawn twice as often."""
    min_lines: int = 3
    """Fewest lines of a `chain` task's input."""
    max_lines: int = 6
    """Most lines of a `chain` task's input (and of an `append` task's log)."""
    distractors: int = 2
    """Files beside the task's own that no step reads or writes."""
    max_k: int | None = None
    """Most lines a `head` or `tail` step keeps (`its first K lines`); None: up to the input's
    lines minus one. 2 makes every such step keep 2, so the instruction's number never needs
    copying (what the demo's tiny byte-level agent cannot learn, 2026-12-06); at least 2."""
    words: str = "fixed"
    """Where the tasks' words (lines, appended lines, file names) come from: `fixed`, a list
    of 26 (`amber` ... `zephyr`: the demo's tasks and the held-out collections); `random`,
    fresh lowercase strings of 4-7 letters, so a simulator trained on them has to copy what
    it reads instead of recalling one of 26 words (a drill: a fixed pool of strings favours
    memorising over copying); `mixed`, each task's words fixed or fresh with even odds (one
    collection that keeps the 26 and teaches copying)."""

    def __post_init__(self) -> None:
        validate.positive_int(self, "num_tasks", "min_lines", "max_lines")
        validate.integer(self, "max_k", low=2, optional=True)
        validate.integer(self, "seed", "distractors", low=0)
        kinds, known = self.kinds, [*FILEOPS_KINDS, *FILEOPS_DEEP_KINDS, *FILEOPS_DRILL_KINDS]
        validate.require(
            isinstance(kinds, list | tuple) and kinds and all(k in known for k in kinds),
            self,
            "kinds",
            f"a non-empty list drawn from {known}",
        )
        validate.require(
            self.max_lines >= self.min_lines >= 3, self, "min_lines",
            f"at least 3 and at most max_lines ({self.max_lines})",
        )  # fmt: skip
        validate.require(self.distractors <= 6, self, "distractors", "an integer in [0, 6]")
        validate.require(self.words in FILEOPS_WORDS, self, "words", f"one of {FILEOPS_WORDS}")


@dataclass(frozen=True)
class TextopsConfig:
    """The seeded `textops` task family (exact rewards, CPU-cheap)."""

    num_tasks: int = 64
    """How many tasks to generate."""
    seed: int = 0
    """Generator seed: the same seed gives the same tasks."""
    ops: list[str] = field(default_factory=lambda: list(TEXTOPS_OPS))
    """Which operations to draw from."""
    min_len: int = 4
    """Shortest input word."""
    max_len: int = 12
    """Longest input word."""
    from_file_prob: float = 0.25
    """Probability that the input word sits in a setup file (`input.txt`) instead of the
    instruction, so the agent (and the simulator) must read it."""
    hidden_op_prob: float = 0.0
    """Probability that the instruction does not name the operation ("the transformation the
    checker wants"): only a failed attempt's checker verdict says which it is, so an agent
    with several trials (`env.terminal.trials`) can adapt, and a good one fails at most once."""

    def __post_init__(self) -> None:
        validate.positive_int(self, "num_tasks", "min_len", "max_len")
        validate.integer(self, "seed", low=0)
        ops = self.ops
        validate.require(
            isinstance(ops, list | tuple) and ops and all(o in TEXTOPS_OPS for o in ops),
            self,
            "ops",
            f"a non-empty list drawn from {list(TEXTOPS_OPS)}",
        )
        validate.require(
            self.max_len >= self.min_len, self, "max_len", f"at least min_len ({self.min_len})"
        )
        validate.fraction(
            self, "from_file_prob", "hidden_op_prob", allowed="a probability in [0, 1]"
        )


@dataclass(frozen=True)
class GrammarConfig:
    """What `sample_case` draws from."""

    seed: int = 0
    min_len: int = 1
    """Shortest random word."""
    max_len: int = 14
    """Longest random word (textops words have 4-12 letters)."""
    repeat_prob: float = 0.35
    """Share of words drawn from a small alphabet (3-6 letters), so letters repeat: copying and
    sorting must then track positions, not only letters."""
    textops_prob: float = 0.5
    """Share of commands in the textops agent's shape (`[echo MARKER\\n]tr -d '\\n' <
    input.txt | OP`)."""
    error_prob: float = 0.12
    """Share of commands made to fail (a misspelt program, a missing file, a bad option)."""
    commands_per_case: int = 6
    """Commands run against one workspace (each is its own example)."""
    session_prob: float = 0.1
    """Share of cases whose first `session_turns` commands are also kept as one session."""
    session_turns: int = 2
    """Commands in a session (2 to `commands_per_case`): each of its commands is an example
    with the turns before it in its context, as a simulator sees them in a real episode."""
    bare_prob: float = 0.3
    """Share of cases with no files: the words are in the commands (`printf`/`echo`), so the
    rows are short and the word is a few dozen bytes before the output: the distance at which
    copying is learned first (a curriculum starts with these)."""
    op_weights: dict[str, float] | None = None
    """Relative weights of the textops operations (`reverse`, `upper`, `sort`, `count`) in the
    commands of the agent's shape, e.g. `{sort: 2, count: 2}` (an operation not named weighs
    1); None: all equal."""
    typo_prob: float = 0.1
    """Share of the agent-shaped commands with one character dropped anywhere (the textops
    noise's typo: a misspelt marker, program, option or file name)."""
    program_typo_prob: float = 0.0
    """Share of those typos that drop a character of a program's name instead (`wc -c` ->
    `w -c`, `tr` -> `t`): in the pipeline's last stage they decide its exit code, which the
    simulator writes before any output."""
    count_present_prob: float = 0.8
    """Share of the agent-shaped count commands (`tr -cd 'c' | wc -c`) whose letter is drawn
    from the word; the others draw any letter, so most of them count 0 (the demo's tasks
    draw 80% / 20% too)."""
    count_near_miss_prob: float = 0.0
    """Share of the other count commands whose letter is one the prompt holds around the word
    but the word does not (the files header's and the command's own letters: `t`, `c`, `e`,
    `n`, `s`, `u`, `w`, ...), as often as it occurs there: a zero the simulator must not
    count from the command. Probed on every letter, the fine-tuned simulator of 2026-12-01
    answered `1` for such absent letters (`c`, `e`, `n`, `s`, `t`, `u`, `w`), mostly `0`
    for the others."""

    def __post_init__(self) -> None:
        if self.op_weights is not None:
            w = self.op_weights
            ok = (
                isinstance(w, dict)
                and all(k in STRING_OPS for k in w)
                and all(
                    isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
                    for v in w.values()
                )
            )
            validate.require(
                ok and any(w.get(op, 1.0) > 0 for op in STRING_OPS),
                self,
                "op_weights",
                f"a mapping from operations in {list(STRING_OPS)} to weights >= 0, not all of "
                "them 0",
            )
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"GrammarConfig: min_len={self.min_len}, max_len={self.max_len} is invalid: "
                "1 <= min_len <= max_len"
            )
        probs = (
            "repeat_prob",
            "textops_prob",
            "error_prob",
            "session_prob",
            "bare_prob",
            "typo_prob",
            "program_typo_prob",
            "count_present_prob",
            "count_near_miss_prob",
        )
        validate.fraction(self, *probs, allowed="within [0, 1]")
        validate.integer(self, "commands_per_case", low=1, allowed=">= 1")
        validate.require(
            2 <= self.session_turns <= max(2, self.commands_per_case),
            self,
            "session_turns",
            f"from 2 to commands_per_case ({self.commands_per_case})",
        )
