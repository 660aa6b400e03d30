"""The chat REPL: builds the session from the flags, streams replies, runs the slash commands."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ChatKitError, ContextWindowExceededError, DistributedError, InvalidParamsError
from ..images import Image, as_image
from .args import (
    CHAT_MAX_TOKENS,
    COMMANDS,
    KEYS,
    UsageError,
    adapter_key,
    check_save_path,
    context_policy,
    explicit_settings,
    fit_adapter,
    kv_group_size,
    load_draft,
    load_model,
    prompt_cache,
    prompt_cache_folder,
    read_adapter,
)
from .compaction import Preparation, compaction_notice, context_report
from .resume import from_transcript, saved_policy, unreadable_as_file_error
from .terminal import ReplyKeys, history_path, line_reader
from .tools import import_tools, join_tools, mcp_servers, tools_report


@dataclass
class _LastTurn:
    """What ``/stats`` says about the last turn: its stats, or why there are none."""

    stats: Any = None
    note: str = "none yet"


class Repl:
    """The chat loop; ``out`` and ``err`` are where it prints (a terminal, or a test's buffers; by default
    ``sys.stdout`` and ``sys.stderr`` as they are when the loop is made)."""

    def __init__(self, args: argparse.Namespace, out: Any = None, err: Any = None) -> None:
        self.args = args
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.keys = ReplyKeys()
        # Checked before loading anything: a bad path fails at once, not at every turn.
        self.save_path = check_save_path(args.save) if args.save else None
        self.user_tools = import_tools(args.tools or [])
        from .. import demo

        # SmolLM2 gets chatkit's tools adapter and the demo's calculate tool (--no-adapter: the base model alone).
        self.tuned = (args.model == "smollm2" and not getattr(args, "no_adapter", False) and args.adapter is None
                      and args.distributed is None)
        if args.model in (None, "demo") or self.tuned:  # a clash with the demo's tools, refused before it loads
            join_tools(demo.tools(), self.user_tools)
        if self.tuned and not self.user_tools:  # SmolLM2 sees no tool schemas; its adapter learned calculate without them
            warnings.filterwarnings("ignore", message="This chat template does not render the tools")
        # A bad folder fails before the model loads; SmolLM2's default is chatkit's shipped adapter.
        self.adapter = read_adapter(str(demo.smollm2_adapter_path()) if self.tuned else args.adapter)
        self.prompt_cache = prompt_cache(args, prompt_cache_folder())  # a folder that cannot be used: before loading
        parser = {"tool_parser_type": demo.SMOLLM2_TOOL_PARSER} if self.tuned else {}
        self.lm = load_model(args.model, distributed=args.distributed, distributed_timeout=args.distributed_timeout,
                             **parser)
        fit_adapter(self.adapter, self.lm)
        group = self.lm.distributed
        self.group = group if group is not None and group.sharded else None  # ranks in lockstep
        if self.group is not None and not self.group.leader:
            self.out = open(os.devnull, "w")  # noqa: SIM115  rank 0 prints the conversation
        # A draft model, "prompt_lookup" (drafts from the conversation itself), or None.
        self.draft = load_draft(args.draft)
        self.last = _LastTurn()
        self.images: list[Image] = []  # attached with /image, sent with the next message
        self.preparation = Preparation()  # the next compaction, prepared while the user types
        self.session = self._build(resume=args.resume)

    # -- building the session ---------------------------------------------------------------------
    def _build(self, resume: str | None = None):
        """A session from the flags, or from a saved file with the flags given explicitly on top."""
        from ..decode.speculative import SpeculativeConfig
        from ..params import GenerateParams
        from ..session.session import ChatSession

        a = self.args
        builder = ChatSession.builder(self.lm).prefill_progress(self._progress)
        builder = builder.prompt_cache(self.prompt_cache if self.group is None else None)  # (sharded: none)
        builder = builder.adapter(self.adapter, 1.0 if a.adapter_scale is None else a.adapter_scale)
        if a.max_kv_size is not None:
            builder = builder.max_kv_size(a.max_kv_size)
        if getattr(a, "max_kv_bytes", None) is not None:
            builder = builder.max_kv_bytes(a.max_kv_bytes)
        if a.kv_bits is not None:
            builder = builder.kv_bits(a.kv_bits, group_size=kv_group_size(a, self.lm.head_dim))
        explicit = explicit_settings(a)
        if a.system is not None:
            builder = builder.instructions(a.system)
        if a.context_policy is not None or resume is None:
            builder = builder.context_policy(context_policy(a.context_policy))
        else:  # the file's policy (one saved before policies existed: the chat's default)
            builder = builder.context_policy(unreadable_as_file_error(lambda: saved_policy(resume), resume))
        if resume is None:
            builder = builder.generate_params(GenerateParams(
                max_tokens=a.max_tokens if a.max_tokens is not None else CHAT_MAX_TOKENS,
                temperature=a.temp if a.temp is not None else 0.0,
            ))
        else:
            transcript_only = unreadable_as_file_error(lambda: self._transcript_only(resume), resume)
            if transcript_only:
                builder = unreadable_as_file_error(
                    lambda: from_transcript(builder, resume, keep_instructions=a.system is None), resume)
            else:
                builder = builder.cache(resume)
        builtin: list[Any] = []
        from .. import demo

        if (a.model in (None, "demo") and getattr(self.lm.tokenizer, "has_tool_calling", False)) or self.tuned:
            builtin = demo.tools()  # a demo trained to call its calculator (v2) gets it; --tools join it
        servers = mcp_servers(a.mcp or [], resume if resume is not None and not transcript_only else None)
        for server in getattr(self, "servers", []):
            server.close()  # a session built again (/load) gets connections of its own
        self.servers = servers
        self.tools = [*join_tools(builtin, self.user_tools), *(t for s in servers for t in s.tools())]
        tools = self.tools
        if tools:
            builder = builder.tools(tools)
        if self.draft is not None:
            builder = builder.speculative(SpeculativeConfig(self.draft, num_draft_tokens=a.num_draft))
        session = unreadable_as_file_error(builder.build, resume) if resume is not None else builder.build()
        if resume is not None and explicit:
            changes = {"temperature": a.temp, "max_tokens": a.max_tokens}
            session.generate_params = session.generate_params.copy(
                **{k: v for k, v in changes.items() if v is not None}
            )
        if resume is not None:
            note = f"resumed {resume}: {len(session.history)} messages"
            note += f" ({transcript_only}: the first turn prefills the conversation again)" if transcript_only else (
                f", {session.cache_info().tokens} tokens cached")
            if explicit:
                note += f"; {', '.join(explicit)} from the command line override the file's"
            self.note(note)
        return session

    def _transcript_only(self, path: str) -> str:
        """Why the saved cache cannot be restored with these flags ('' when it can): the transcript is
        the truth, so the conversation is restored from it and prefilled anew."""
        from ..session.saved import inspect as inspect_file

        info = inspect_file(path)
        if info.kind == "chatkit" and (info.fingerprint or {}).get("adapter") != adapter_key(self.adapter, self.args):
            return "the saved cache was made with another adapter (or none) than --adapter gives, so it is not restored"
        if self.draft is not None and self.draft != "prompt_lookup":  # a draft model's cache would have to match
            return "with --draft the saved cache is not restored"
        saved = (info.cache_options or {}).get("max_kv_size")
        if self.args.max_kv_size is not None and self.args.max_kv_size != saved:
            return f"the saved cache was not made with --max-kv-size {self.args.max_kv_size}, so it is not restored"
        return ""

    def _progress(self, done: int, total: int) -> None:
        if total >= 256:  # only long prompts are worth a progress line
            end = "\n" if done >= total else ""
            print(f"\r[prefill {done}/{total} tokens]", end=end, file=self.err, flush=True)

    # -- printing -----------------------------------------------------------------------------------
    def say(self, text: str = "", end: str = "\n") -> None:
        print(text, end=end, file=self.out, flush=True)

    def note(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def dim_note(self, text: str) -> None:
        """A note about the conversation rather than part of it (dimmed in a terminal)."""
        self.note(f"\x1b[2m{text}\x1b[0m" if getattr(self.err, "isatty", lambda: False)() else text)

    def error(self, exc: BaseException) -> None:
        if self.group is not None and not self.group.leader and not isinstance(exc, DistributedError):
            return  # the ranks run the same calls: rank 0 reports the error
        detail = str(exc) if isinstance(exc, ChatKitError) else f"{type(exc).__name__}: {exc}"
        print(f"error: {detail}", file=self.err, flush=True)

    # -- the loop -----------------------------------------------------------------------------------
    def run(self, read: Callable[..., str] | None = None) -> int:
        interactive = sys.stdin.isatty()
        if not interactive and hasattr(sys.stdin, "reconfigure"):
            sys.stdin.reconfigure(errors="replace")  # piped bytes that are not UTF-8 must not end the chat
        read = read or line_reader(interactive and sys.stdout.isatty())
        if interactive:
            adapter = f" + adapter {self.args.adapter}" if self.args.adapter else ""
            self.say(f"chatkit: chatting with {self.args.model or 'the demo model'}{adapter}. /help for commands, Ctrl-D to quit.")
        with self.keys.installed():
            self._loop(read, interactive)
        self.prepared()
        self.autosave()
        return 0

    def _loop(self, read: Callable[..., str], interactive: bool) -> None:
        while True:
            self.keys.pressed.clear()
            try:
                line = self.read_line(lambda: read(self.keys.take_typed()) if interactive else read())
            except EOFError:  # Ctrl-D (the reader ends the line) or the end of piped input
                break
            except KeyboardInterrupt:
                continue
            self.prepared()
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if self.command(line) is False:
                    break
            else:
                self.turn(line)

    def read_line(self, read: Callable[[], str]) -> str:
        """The next input line; over a sharded model rank 0 reads it and every rank gets it."""
        if self.group is None:
            return read()
        from ..distributed import broadcast_text

        line: str | None = None
        if self.group.leader:
            try:
                line = read()
            except EOFError:
                line = None
        line = broadcast_text(self.group, line)
        if line is None:
            raise EOFError
        return line

    def turn(self, line: str) -> None:
        """Answer ``line``: stream the reply, then save it when --save was given and prepare the next
        compaction while the user types."""
        images, self.images = self.images, []
        if self.reply(lambda: self.session.stream_respond(line, images=images), line):
            self.autosave()
            self.prepare()

    def prepare(self) -> None:
        """Prepare the next compaction on a thread (when the policy compacts: it is cheap until the context
        nears the window); :meth:`prepared` waits for it."""
        if self.group is None and self.session.context_policy.mode != "error":
            self.preparation.start(self.session)

    def prepared(self) -> None:
        """Wait for the preparation started after the last reply; say why it failed, if it did."""
        error = self.preparation.wait()
        if error is not None:
            detail = str(error) if isinstance(error, ChatKitError) else f"{type(error).__name__}: {error}"
            self.dim_note(f"· the next compaction could not be prepared ahead ({detail}); the turn that needs "
                          "it compacts by itself")

    def reply(self, start: Callable[[], Any], message: str) -> bool:
        """Stream a reply; Ctrl-C stops it after the token being computed and keeps what came.
        Returns whether a reply was committed."""
        printed, dropped = False, len(self.session.dropped_messages)
        with self.keys.active() as keys:
            try:
                with start() as stream:
                    for chunk in stream:
                        self.say(_shown(chunk, self.args, self.out), end="")
                        printed = printed or bool(chunk.text)
                        if keys.pressed.is_set():
                            break
            except DistributedError:
                raise  # a rank died or hung: this rank cannot go on alone
            except Exception as exc:  # one clear line, never a traceback; the session goes on
                self.last = _LastTurn(note=f"failed ({type(exc).__name__}); the conversation is unchanged")
                if printed:
                    self.say()
                if isinstance(exc, ContextWindowExceededError):
                    self.note(f"error: {self._too_long(exc, message)}")
                else:
                    self.error(exc)
                return False
            stopped = keys.pressed.is_set()
        self.say(" [stopped]" if stopped else _cut_marker(stream.stats, self.session.generate_params.max_tokens, self.out))
        self.last = _LastTurn(stream.stats)
        notice = compaction_notice(stream.stats, len(self.session.dropped_messages) - dropped)
        if notice is not None:
            self.dim_note(notice)
        return True

    def _too_long(self, exc: ContextWindowExceededError, message: str) -> str:
        """Whether /undo or /clear can help: not when the message (with the system prompt) alone is too long."""
        from ..session.session import ChatSession

        s = self.session
        kv = s.cache_options.max_kv_size
        builder = ChatSession.builder(s.model).instructions(s.instructions).generate_params(s.generate_params.copy())
        alone = builder.max_kv_size(kv).context_policy(s.context_policy).build()
        rotating = kv is not None and kv == s.context_window and s.context_policy.mode != "error"  # the policy's window
        window = "--max-kv-size window" if rotating else "model's context window"
        try:
            alone.stream_respond(message).close()  # raises at once if it cannot fit; runs nothing
        except ContextWindowExceededError as own:
            system = " and the system prompt take" if s.instructions else " takes"
            shorter = " (or a shorter system prompt: /system TEXT)" if s.instructions else ""
            larger = f"; or start again with a larger --max-kv-size than {kv}" if rotating else ""
            return (f"This message{system} {own.prompt_tokens} tokens, more than the {window} "
                    f"of {own.context_length}: /clear or /undo would not help. Send a shorter message{shorter}{larger}.")
        if s.context_policy.mode != "error":
            return (f"Even with the older exchanges dropped from what the model sees, this message does not fit the "
                    f"{window} ({exc.prompt_tokens} tokens, the window is {exc.context_length}): /undo drops the last "
                    "exchange, /clear starts over (the system prompt stays).")
        return (f"The conversation no longer fits the {window} ({exc.prompt_tokens} tokens with "
                f"this message, the window is {exc.context_length}): /undo drops the last exchange, "
                "/clear starts over (the system prompt stays), or start again with --context-policy rolling.")

    def autosave(self) -> None:
        if self.save_path is None or self.session.cache_info().tokens == 0:
            return
        with self.keys.active():
            try:
                self.session.save_cache(self.save_path)
            except Exception as exc:  # a full disk or a folder removed meanwhile: say it, go on
                self.error(exc)

    # -- slash commands -----------------------------------------------------------------------------
    def command(self, line: str) -> bool | None:
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        try:
            with self.keys.active():
                return self._command(name, rest)
        except DistributedError:
            raise  # a rank died or hung: this rank cannot go on alone
        except Exception as exc:  # one clear line, never a traceback; the session goes on
            self.error(exc)
            return None

    def _command(self, name: str, rest: str) -> bool | None:
        s = self.session
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            path = history_path()
            self.say(COMMANDS + "\n" + KEYS.format(history=path if path is not None else "no file"))
        elif name == "/save":
            size = s.save_cache(check_save_path(_need(rest, "/save FILE"), flag="/save"))
            self.say(f"saved {s.cache_info().tokens} tokens, {len(s.history)} messages to {rest} ({size:,} bytes)")
        elif name == "/load":
            self.session = self._build(resume=_need(rest, "/load FILE"))
            self.last = _LastTurn(note=f"none since {rest} was loaded")
            self.say(f"loaded {rest}: {len(self.session.history)} messages, {self.session.cache_info().tokens} tokens cached")
        elif name == "/undo":
            dropped = s.undo()
            self.last = _LastTurn(note="undone")
            self.say(f"undone: {dropped[0].content!r}")
        elif name == "/retry":
            history = s.history
            if self.reply(s.stream_regenerate, history[-2].content if len(history) >= 2 else ""):
                self.autosave()
                self.prepare()
        elif name == "/clear":
            s.clear()
            self.last = _LastTurn(note="none since /clear")
            self.say("cleared")
        elif name == "/system":
            s.instructions = rest or None
            self.say(f"system prompt {'set' if rest else 'removed'}")
        elif name == "/image":
            if self.lm.vision is None:
                raise InvalidParamsError("This model reads no images: chat with a vision-language model (--model).")
            self.images.append(as_image(_need(rest, "/image PATH")))
            self.say(f"attached {rest} ({self.images[-1].width}x{self.images[-1].height}): it goes with your next message")
        elif name == "/stats":
            self.say(self.stats())
        elif name == "/tools":
            self.say(tools_report(self.tools))
        elif name == "/context":
            self.say(context_report(s))
        else:
            self.say(f"unknown command {name}; /help lists them")
        return None

    def stats(self) -> str:
        """What the cache holds now, and what the last turn cost (if it still stands)."""
        s = self.session
        info, st = s.cache_info(), self.last.stats
        if info.tokens == 0:
            cache = "cache: empty (the next turn prefills the whole conversation)"
        else:
            classes = sorted(set(info.layer_classes))
            cache = f"cache: {info.tokens} tokens, {info.nbytes:,} bytes, {len(info.layer_classes)} layers ({', '.join(classes)})"
            if "RotatingKVCache" in classes:
                cache += f"; a window of the last {s.cache_options.max_kv_size} tokens at most"
        lines = [f"conversation: {len(s.history)} messages" + (", with a system prompt" if s.instructions else ""), cache]
        if s.adapter is not None:
            lines.append(f"adapter: {s.adapter.path} ({s.adapter.kind}, rank {s.adapter.rank}), scale {s.adapter_scale:g}")
        if st is None:
            lines.append(f"last turn: {self.last.note}")
        else:
            lines.append(
                f"last turn: prompt {st.prompt_tokens} tokens ({st.reused_tokens} reused, {st.prefilled_tokens} prefilled "
                f"at {st.prompt_tps:.0f} tok/s), {st.generation_tokens} generated at {st.generation_tps:.1f} tok/s, "
                f"peak memory {st.peak_memory_bytes / 2**20:.0f} MiB, finish: {st.finish_reason}"
                + (f"; compacted: {st.dropped_tokens} tokens dropped from the context" if st.compacted else "")
            )
            if self.session.speculative is not None:
                lines.append(f"draft: {st.draft_tokens_accepted}/{st.draft_tokens_proposed} proposed tokens accepted, "
                             f"{st.draft_length:.1f} drafted per step")
        return "\n".join(lines)


def _shown(chunk: Any, args: argparse.Namespace, out: Any) -> str:
    """A chunk as the REPL prints it: reasoning dimmed (or hidden), tool calls and results on lines of their own."""
    from ..text.reply import PieceKind  # here: the REPL starts before the model layers are imported

    dim = (lambda t: f"\x1b[2m{t}\x1b[0m") if getattr(out, "isatty", lambda: False)() else (lambda t: t)
    if chunk.kind == PieceKind.REASONING:
        return "" if args.hide_thinking else dim(chunk.text)
    if chunk.kind == PieceKind.TOOL_CALL:
        call = chunk.tool_call
        return "" if call is None else dim(f"\n[tool call] {call.name}({json.dumps(call.arguments)})\n")
    if chunk.kind == PieceKind.TOOL_RESULT:
        return dim(f"[tool result] {chunk.text}\n")
    return chunk.text


def _cut_marker(stats: Any, max_tokens: int, out: Any) -> str:
    """A dim `` [cut at max_tokens ...]`` after a reply that reached its length limit ('' otherwise)."""
    if stats is None or stats.finish_reason != "length":
        return ""
    text = f"[cut at max_tokens ({max_tokens}): start chatkit with a larger --max-tokens for longer replies]"
    return " " + (f"\x1b[2m{text}\x1b[0m" if getattr(out, "isatty", lambda: False)() else text)


def _need(value: str, usage: str) -> str:
    if not value:
        raise UsageError(f"usage: {usage}")
    return value


__all__ = ["Repl"]
