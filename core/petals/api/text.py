"""The text of a growing token sequence, released piece by piece, with stop strings.

A stop string may span several tokens ("###" can come as "#" then "##"), so stops are checked on
the decoded text, never on token ids. Text that could still become the start of a stop string is
held back until the next tokens show whether it does, and so is a trailing incomplete UTF-8
character (decoded as U+FFFD), so a client never receives text that is later taken back.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHARACTER = "\ufffd"
# the longest stop string a request may pass: each token compares the text's tail with every prefix of it
MAX_STOP_LENGTH = 256


class StreamingText:
    """Feed token ids one by one with ``push``; each call returns the text that is now final."""

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [string for string in stop if string]
        self.include_stop = include_stop  # release the stop string itself as the last text
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything released so far
        self.stopped = False  # a stop string was found: nothing more is released

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        decoded = self._decode()
        found = self._find_stop(decoded)
        if found is not None:
            self.stopped = True
            start, string = found
            return self._release(decoded[: start + len(string) if self.include_stop else start])
        if decoded.endswith(REPLACEMENT_CHARACTER):  # an incomplete multi-byte character
            return ""
        return self._release(decoded[: len(decoded) - self._held_back(decoded)])

    def flush(self) -> str:
        """At the end of generation: release what was held back (unless a stop string ended it)."""
        if self.stopped or not self.token_ids:
            return ""
        return self._release(self._decode())

    def _decode(self) -> str:
        return self.tokenizer.decode(
            self.token_ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _find_stop(self, decoded: str) -> tuple[int, str] | None:
        """The earliest stop string and where it starts, looking only where new text could complete one."""
        longest = max((len(string) for string in self.stop), default=0)
        start = max(len(self.text) - longest + 1, 0)
        found = [(index, string) for string in self.stop if (index := decoded.find(string, start)) != -1]
        return min(found) if found else None

    def _held_back(self, decoded: str) -> int:
        """Length of the longest tail of ``decoded`` that is a proper prefix of some stop string."""
        tail_lengths = [
            length
            for string in self.stop
            for length in range(min(len(string) - 1, len(decoded)), 0, -1)
            if decoded.endswith(string[:length])
        ]
        return max(tail_lengths, default=0)

    def _release(self, final: str) -> str:
        new = final[len(self.text) :]  # decoding is prefix-stable: more tokens only append text
        self.text += new
        return new
