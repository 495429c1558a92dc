"""The typed step request: normalised once, documents by ids or by text, ids resolved by one rule."""

from __future__ import annotations

import numpy as np
import pytest

from ralm.drafting import StepOptions
from ralm.drafting.idgr import idgr_block
from ralm.step_request import StepRequest, doc_texts

pytestmark = pytest.mark.unit


class _Corpus:
    def text(self, doc_id: int) -> str:
        return f"passage {doc_id}"


def test_a_request_is_normalised_to_plain_ints_and_tuples():
    r = StepRequest([np.int64(5), 7], np.int64(3), doc_ids=[np.int64(2), 9], ignore_eos=1)
    assert r == StepRequest((5, 7), 3, doc_ids=(2, 9), ignore_eos=True)
    assert type(r.k) is int and all(type(t) is int for t in (*r.context, *r.doc_ids))  # type: ignore[misc]
    assert StepRequest((1,), 2, doc_ids=np.int64(4)).doc_ids == 4
    with pytest.raises(ValueError, match="not both"):
        StepRequest((1,), 2, doc_ids=3, doc_texts=("text",))


def test_doc_ids_resolve_to_the_prompt_documents_and_the_idgr_block():
    c = _Corpus()
    assert doc_texts(c, None) == [] and doc_texts(c, 3) == ["passage 3"]
    assert doc_texts(c, (3, 8)) == ["passage 3", "passage 8"]  # no options: every id is a document
    assert doc_texts(c, (3, 8, 1), StepOptions(num_docs=2)) == ["passage 3", "passage 8"]
    idgr = StepOptions(num_docs=1, idgr=True)
    assert doc_texts(c, (3, 8, 1), idgr) == ["passage 3", idgr_block([3], [8, 1])]
    assert doc_texts(c, None, idgr) == [idgr_block([], [])]
