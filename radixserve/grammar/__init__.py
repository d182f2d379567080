"""Constrained decoding with xgrammar: JSON schema, regex, EBNF and structural tags.

``compiler.py`` compiles grammar texts off the scheduler's step loop, with a cache shared by
all requests; ``matcher.py`` is one request's matcher (token masks, jump-forward).
"""

from radixserve.grammar.compiler import GrammarCompiler, GrammarError, GrammarKey
from radixserve.grammar.matcher import RequestGrammar

__all__ = ["GrammarCompiler", "GrammarError", "GrammarKey", "RequestGrammar"]
