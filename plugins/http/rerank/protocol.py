"""The request bodies of ``POST /v1/rerank`` and ``POST /v1/score``.

``/v1/rerank`` takes the shape llama-server, vLLM, Jina and Cohere share: a ``query``, its
``documents`` (strings, or objects with a ``text``, as Cohere's v1 client and Jina send them),
``top_n`` and ``return_documents``; and Cohere v2's ``max_tokens_per_doc``. ``/v1/score`` takes
vLLM's: ``text_1`` and ``text_2``, each a string or a list, scored pairwise (one ``text_1``
against every ``text_2``, or the two lists zipped). Each field is declared once here; the
validator and ``/openapi.json`` both come from it (:mod:`..typed`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from superfluid.core.errors import InvalidRequest

from ..extension import Extension
from ..typed import Lenient, NamedByField, RequestBody, fail

MAX_DOCUMENTS = 1000  # documents (or pairs) per request: Cohere's limit; each is a lane of its own


class Document(Lenient):
    """A document as an object (Cohere v1, Jina): its ``text`` is what is ranked; other fields
    are ignored."""

    text: str


def _nonempty(texts: list[str], field: str) -> list[str]:
    for i, text in enumerate(texts):
        if not text:
            raise fail("invalid_value", f"[{i}] is empty: every {field} needs text to be scored")
    return texts


class RerankRequest(RequestBody):
    """The body of ``POST /v1/rerank`` (also ``/rerank`` and Cohere v2's ``/v2/rerank``)."""

    model: str | None = Field(None, description="a served reranker; null or empty: the first model")
    query: Annotated[str, Field(min_length=1)] = Field(description="what the documents are ranked against")
    documents: Annotated[list[str | Document], Field(min_length=1, max_length=MAX_DOCUMENTS), NamedByField] = Field(
        description=f"1 to {MAX_DOCUMENTS} documents: strings, or objects with a text field")
    top_n: Annotated[int, Field(ge=1)] | None = Field(
        None, description="how many results, best first (default: all of them)")
    return_documents: bool | None = Field(True, description="each result carries its document ({text})")
    max_tokens_per_doc: Annotated[int, Field(ge=1)] | None = Field(
        None, description="cut each document to this many tokens (Cohere v2); default: not cut, and a "
                          "pair longer than the context is a 400")
    superfluid: Extension | None = None

    @field_validator("documents")
    @classmethod
    def _texts(cls, documents):
        _nonempty([d if isinstance(d, str) else d.text for d in documents], "document")
        return documents

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


Texts = Annotated[str | Annotated[list[str], Field(min_length=1, max_length=MAX_DOCUMENTS)], NamedByField]


class ScoreRequest(RequestBody):
    """The body of ``POST /v1/score`` (also ``/score``): vLLM's."""

    model: str | None = Field(None, description="a served reranker; null or empty: the first model")
    text_1: Texts = Field(description="a query, or a list of them (one, or as many as text_2)")
    text_2: Texts = Field(description="a document, or a list of them")
    superfluid: Extension | None = None

    @field_validator("text_1", "text_2")
    @classmethod
    def _texts(cls, value):
        _nonempty([value] if isinstance(value, str) else value, "text")
        return value

    def pairs(self) -> list[tuple[str, str]]:
        """The (query, document) pairs in order: a single ``text_1`` against each ``text_2``, or
        the two lists zipped (vLLM's rule); lists of other lengths are a 400."""
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise InvalidRequest(f"text_1 has {len(first)} texts and text_2 {len(second)}: text_1 must be one "
                                 "text, or as many as text_2", param="text_1", code="invalid_value")
        return list(zip(first, second))
