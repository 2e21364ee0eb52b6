"""What computed a set of vectors (:class:`VectorSource`) and whether two sets may meet in one
store (:func:`disagreement`): the runtime rule of :mod:`densefit.retrieval.runtimes`, kept
apart from it because stores record it and a store's records load no framework.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from densefit.choices import PRECISIONS

__all__ = ["FP32", "VectorSource", "disagreement"]

FP32 = "fp32"


@dataclass(frozen=True)
class VectorSource:
    """What computed a set of vectors: the runtime, its file and its family.

    ``family`` is ``"fp32"`` for torch and fp32 exports, ``"int8:<sha256 prefix>"`` for a
    quantized file, ``"fp16"`` / ``"bf16"`` for torch at that ``precision``;
    ``agrees_with_fp32``: the file's or precision's check found it ranks like fp32 when
    queries and documents come from the two families (always True for fp32).

    >>> VectorSource().family, VectorSource().precision
    ('fp32', 'fp32')
    """

    runtime: str = "torch"
    family: str = FP32
    file: str | None = None  # relative to the model folder ("onnx/model.onnx")
    agrees_with_fp32: bool = True
    precision: str = FP32  # the transformer's number format (torch: --precision)

    def to_json(self) -> str:
        """The store's meta entry."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> VectorSource:
        """Read a store's entry; a store without one was written by torch (fp32), an entry
        without a precision (written before it was recorded) in fp32."""
        if not text:
            return cls()
        data = json.loads(text)
        fields = {k: data[k] for k in ("runtime", "family", "file", "agrees_with_fp32")}
        return cls(**fields, precision=data.get("precision", FP32))

    def describe(self) -> str:
        """``onnx-int8 (onnx/model_qint8_avx2.onnx)`` / ``torch`` / ``torch fp16``."""
        if self.file:
            return f"{self.runtime} ({self.file})"
        return self.runtime if self.precision == FP32 else f"{self.runtime} {self.precision}"


def disagreement(stored: VectorSource, given: VectorSource, *, mixing: bool) -> str | None:
    """Why vectors from ``given`` may not meet vectors from ``stored``, or None when they may.

    ``mixing``: ``given`` would write documents beside ``stored``'s (indexing): only the same
    family. Otherwise ``given`` embeds queries against ``stored``'s documents: the same family,
    fp32 against a quantized file whose check says it agrees with fp32, or torch at any two
    precisions (each checked against fp32).

    >>> int8 = VectorSource("onnx-int8", "int8:ab12", "onnx/model_qint8_avx2.onnx", True)
    >>> disagreement(int8, VectorSource(), mixing=False) is None
    True
    >>> disagreement(int8, VectorSource(), mixing=True)[:40]
    'documents were embedded by onnx-int8 (on'
    """
    if stored.family == given.family:
        return None
    what = "documents were embedded" if mixing else "the store's documents were embedded"
    reason = f"{what} by {stored.describe()}, this run embeds with {given.describe()}"
    if mixing:
        return reason + ": one store holds vectors of one runtime family"
    checked = (stored.agrees_with_fp32, given.agrees_with_fp32)
    if {stored.family, given.family} <= set(PRECISIONS) and all(checked):
        return None  # fp32 and half precisions, each checked against fp32: queries cross
    quantized = given if stored.family == FP32 else stored
    if FP32 in (stored.family, given.family) and quantized.agrees_with_fp32:
        return None
    if FP32 not in (stored.family, given.family):
        return reason + ": two different quantized exports are never compared"
    return reason + (
        f": the check of {quantized.describe()} did not find that its vectors rank like "
        "fp32 ones when mixed with them"
    )
