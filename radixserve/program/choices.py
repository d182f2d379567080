"""How ``select`` decides among its choices from the model's logprobs of each.

Every method sees, per choice, the logprobs of the choice's tokens after the prompt
(``token_logprobs``, entries ``[logprob, token_id, text]``); the unconditional method also sees
the same tokens scored without the prompt.  The methods follow the ones SGLang's frontend
offers, so a program moved from SGLang decides the same way:

- token-length-normalised: the highest mean token logprob;
- greedy token selection: walk the tokens left to right, keeping the choices with the best
  logprob at each position (a shorter choice is padded with its own mean);
- unconditional-likelihood-normalised: the highest mean of (logprob with the prompt −
  logprob without it), which favours choices the prompt makes likelier than they are anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Entry = list[Any]  # [logprob, token_id, text]


@dataclass(frozen=True)
class ChoiceScores:
    """A decision and every choice's numbers (stored as the variable's meta info)."""

    decision: str
    index: int
    scores: list[float]  # what the method compared, one per choice
    meta_info: dict[str, Any]


def mean_logprob(entries: list[Entry]) -> float:
    return sum(float(e[0]) for e in entries) / len(entries)


class ChoicesMethod:
    name = ""
    needs_unconditional = False

    def scores(self, token_logprobs: list[list[Entry]],
               unconditional: list[list[Entry]] | None) -> tuple[list[float], dict[str, Any]]:
        raise NotImplementedError

    def decide(self, choices: list[str], token_logprobs: list[list[Entry]],
               unconditional: list[list[Entry]] | None = None) -> ChoiceScores:
        if self.needs_unconditional and unconditional is None:
            raise ValueError(f"{self.name} needs the choices' unconditional logprobs")
        scores, extra = self.scores(token_logprobs, unconditional)
        best = max(range(len(choices)), key=lambda i: scores[i])  # first of equals
        meta = {
            "method": self.name,
            "choices": list(choices),
            "scores": scores,
            "normalized_prompt_logprobs": [mean_logprob(t) for t in token_logprobs],
            "input_token_logprobs": token_logprobs,
            **extra,
        }
        return ChoiceScores(choices[best], best, scores, meta)

    def __repr__(self) -> str:
        return self.name


class TokenLengthNormalized(ChoicesMethod):
    name = "token_length_normalized"

    def scores(self, token_logprobs: list[list[Entry]],
               unconditional: list[list[Entry]] | None) -> tuple[list[float], dict[str, Any]]:
        return [mean_logprob(t) for t in token_logprobs], {}


class GreedyTokenSelection(ChoicesMethod):
    """Position by position, keep the choices whose token logprob is the best there; the
    first survivor wins.  The score reported for a choice is the position where it dropped
    out (the winner's is the longest length), so a higher score is a better choice."""

    name = "greedy_token_selection"

    def scores(self, token_logprobs: list[list[Entry]],
               unconditional: list[list[Entry]] | None) -> tuple[list[float], dict[str, Any]]:
        width = max(len(t) for t in token_logprobs)
        # [choice][position]: the token's logprob, or past the choice's end its own mean.
        matrix = [[float(e[0]) for e in t] + [mean_logprob(t)] * (width - len(t))
                  for t in token_logprobs]
        alive = list(range(len(matrix)))
        dropped_at = [float(width)] * len(matrix)
        for j in range(width):
            best = max(matrix[i][j] for i in alive)
            for i in alive:
                if matrix[i][j] != best:
                    dropped_at[i] = float(j)
            alive = [i for i in alive if matrix[i][j] == best]
            if len(alive) == 1:
                break
        for i in alive[1:]:  # ties to the end: the first survivor wins
            dropped_at[i] = float(width) - 0.5
        return dropped_at, {"greedy_logprob_matrix": matrix}


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    name = "unconditional_likelihood_normalized"
    needs_unconditional = True

    def scores(self, token_logprobs: list[list[Entry]],
               unconditional: list[list[Entry]] | None) -> tuple[list[float], dict[str, Any]]:
        assert unconditional is not None  # checked by decide()
        out = []
        for cond, uncond in zip(token_logprobs, unconditional, strict=True):
            # The first unconditional token has no context to be scored from: 0.
            base = [0.0 if e[0] is None else float(e[0]) for e in uncond]
            out.append(sum(float(c[0]) - u for c, u in zip(cond, base, strict=True)) / len(cond))
        return out, {"unconditional_token_logprobs": unconditional}


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
