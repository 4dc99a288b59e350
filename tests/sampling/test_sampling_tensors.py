"""SamplingTensors.build: normalisation, padding rows, min_tokens masks, validation messages."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _sampling_ref import Row

from deepinfer_jax.engine.params import SamplingParams
from deepinfer_jax.sampling import ROW_FIELDS, SamplingTensors

V = 100


def test_values_padding_and_normalisation():
    rows = [
        Row(
            temperature=0.5,
            top_p=0.9,
            top_k=5,
            min_p=0.1,
            repetition_penalty=1.2,
            presence_penalty=-1.5,
            frequency_penalty=2.0,
        ),
        Row(temperature=0.0, top_k=0),
        Row(top_k=-1),
        Row(top_k=10**6),
    ]
    st = SamplingTensors.build(
        rows, [0, 1, (3 << 32) | 4, 2**64 - 1], np.array([3, 0, 17, 2**31 - 1]), V, num_rows=6
    )
    assert st.num_rows == 6
    np.testing.assert_array_equal(st.temperature, np.float32([0.5, 0, 1, 1, 0, 0]))
    np.testing.assert_array_equal(st.top_p, np.float32([0.9, 1, 1, 1, 1, 1]))
    np.testing.assert_array_equal(st.top_k, [5, V, V, V, V, V])  # off (0, -1) and oversize k all mean V
    np.testing.assert_array_equal(st.min_p, np.float32([0.1, 0, 0, 0, 0, 0]))
    np.testing.assert_array_equal(st.repetition_penalty, np.float32([1.2, 1, 1, 1, 1, 1]))
    np.testing.assert_array_equal(st.presence_penalty, np.float32([-1.5, 0, 0, 0, 0, 0]))
    np.testing.assert_array_equal(st.frequency_penalty, np.float32([2.0, 0, 0, 0, 0, 0]))
    np.testing.assert_array_equal(st.seed, [[0, 0], [1, 0], [4, 3], [2**32 - 1, 2**32 - 1], [0, 0], [0, 0]])
    np.testing.assert_array_equal(st.position, [3, 0, 17, 2**31 - 1, 0, 0])
    np.testing.assert_array_equal(st.masked_ids, -np.ones((6, 1)))
    dtypes = {name: getattr(st, name).dtype for name in st._fields}
    assert dtypes == {
        **dict.fromkeys(
            ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"],
            np.float32,
        ),
        "top_k": np.int32,
        "seed": np.uint32,
        "position": np.int32,
        "masked_ids": np.int32,
        "golden": np.int32,
    }


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    rows = [
        Row(min_tokens=3, stop_token_ids=(9, 4)),
        Row(min_tokens=3, stop_token_ids=(9,)),
        Row(min_tokens=3, stop_token_ids=(9,), ignore_eos=True),
        Row(min_tokens=0, stop_token_ids=(9,)),
    ]
    st = SamplingTensors.build(
        rows, [0] * 4, [0] * 4, V, output_lens=[2, 3, 0, 0], eos_token_ids=[1, 2], banned_token_ids=[50]
    )
    assert st.masked_ids.shape == (4, 8)  # row 0 needs 5 ids -> next power of two
    as_sets = [set(r[r >= 0].tolist()) for r in st.masked_ids]
    assert as_sets == [{1, 2, 4, 9, 50}, {50}, {9, 50}, {50}]


def test_mask_width_can_be_fixed_and_is_checked():
    st = SamplingTensors.build([Row()], [0], [0], V, banned_token_ids=[1, 2, 3], mask_width=16)
    assert st.masked_ids.shape == (1, 16)
    with pytest.raises(ValueError, match="mask_width = 2 is smaller than the 3 ids row 0 must mask"):
        SamplingTensors.build([Row()], [0], [0], V, banned_token_ids=[1, 2, 3], mask_width=2)


def test_the_engines_sampling_params_are_accepted():
    params = SamplingParams(temperature=0.3, top_k=4, min_tokens=2, stop_token_ids=[7], seed=5)
    assert all(hasattr(params, f) for f in ROW_FIELDS)
    st = SamplingTensors.build([params], [params.seq_seed], [9], V, eos_token_ids=[0])
    assert st.top_k[0] == 4 and set(st.masked_ids[0].tolist()) == {0, 7}


def test_is_a_pytree_that_moves_to_the_device():
    st = SamplingTensors.build([Row()], [3], [4], V, num_rows=2)
    leaves = jax.tree.leaves(st)
    assert len(leaves) == len(st._fields) == 11
    on_device = jax.device_put(st)
    assert isinstance(on_device, SamplingTensors) and isinstance(on_device.seed, jax.Array)
    assert on_device.num_rows == 2


def test_empty_step_with_only_padding():
    st = SamplingTensors.build([], [], [], V, num_rows=3)
    np.testing.assert_array_equal(st.temperature, [0, 0, 0])


@pytest.mark.parametrize(
    ("row", "error", "message"),
    [
        (Row(temperature=-0.1), ValueError, r"params_list\[1\].temperature = -0.1 is outside \[0, inf\)"),
        (Row(temperature=float("nan")), ValueError, r"params_list\[1\].temperature = nan is outside"),
        (Row(temperature=1e-40), ValueError, r"params_list\[1\].temperature = 1e-40 is below float32"),
        (Row(top_p=0.0), ValueError, r"params_list\[1\].top_p = 0.0 is outside \(0, 1\]"),
        (Row(top_p=1.5), ValueError, r"params_list\[1\].top_p = 1.5 is outside \(0, 1\]"),
        (Row(top_k=-2), ValueError, r"params_list\[1\].top_k = -2 must be >= -1"),
        (Row(top_k=2.0), TypeError, r"params_list\[1\].top_k must be an int, got float"),
        (Row(min_p=1.1), ValueError, r"params_list\[1\].min_p = 1.1 is outside \[0, 1\]"),
        (
            Row(repetition_penalty=0.0),
            ValueError,
            r"params_list\[1\].repetition_penalty = 0.0 is outside \(0, inf\)",
        ),
        (
            Row(presence_penalty=2.5),
            ValueError,
            r"params_list\[1\].presence_penalty = 2.5 is outside \[-2, 2\]",
        ),
        (
            Row(frequency_penalty=-3),
            ValueError,
            r"params_list\[1\].frequency_penalty = -3 is outside \[-2, 2\]",
        ),
        (Row(min_tokens=-1), ValueError, r"params_list\[1\].min_tokens = -1 must be >= 0"),
        (
            Row(min_tokens=1, stop_token_ids=(V,)),
            ValueError,
            r"stop_token_ids\[0\] = 100 is outside the vocabulary",
        ),
        (Row(ignore_eos=1), TypeError, r"params_list\[1\].ignore_eos must be a bool"),
        (Row(temperature="1"), TypeError, r"params_list\[1\].temperature must be a real number, got str"),
    ],
)
def test_bad_row_values_name_field_row_and_limit(row, error, message):
    with pytest.raises(error, match=message):
        SamplingTensors.build([Row(), row], [0, 0], [0, 0], V)


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match="seeds has 1 entries for 2 rows"):
        SamplingTensors.build([Row(), Row()], [0], [0, 0], V)
    with pytest.raises(ValueError, match=r"seeds\[1\]: seed = 18446744073709551616 is outside"):
        SamplingTensors.build([Row(), Row()], [0, 2**64], [0, 0], V)
    with pytest.raises(TypeError, match=r"seeds\[0\]: seed must be an int"):
        SamplingTensors.build([Row()], [None], [0], V)
    with pytest.raises(ValueError, match=r"positions\[1\] = -1 must be in \[0, 2147483647\]"):
        SamplingTensors.build([Row(), Row()], [0, 0], [0, -1], V)
    with pytest.raises(ValueError, match="positions must have 2 entries"):
        SamplingTensors.build([Row(), Row()], [0, 0], [0], V)
    with pytest.raises(ValueError, match=r"output_lens\[0\] = -3 must be >= 0"):
        SamplingTensors.build([Row()], [0], [0], V, output_lens=[-3])
    with pytest.raises(ValueError, match="num_rows = 1 is smaller than the 2 rows given"):
        SamplingTensors.build([Row(), Row()], [0, 0], [0, 0], V, num_rows=1)
    with pytest.raises(ValueError, match="vocab_size = 0 must be >= 1"):
        SamplingTensors.build([Row()], [0], [0], 0)
    with pytest.raises(ValueError, match=r"eos_token_ids\[0\] = 100 is outside the vocabulary \[0, 100\)"):
        SamplingTensors.build([Row()], [0], [0], V, eos_token_ids=[V])
    with pytest.raises(TypeError, match="banned_token_ids must be a sequence of ints"):
        SamplingTensors.build([Row()], [0], [0], V, banned_token_ids=5)
    with pytest.raises(TypeError, match=r"params_list\[0\] \(object\) lacks attribute\(s\)"):
        SamplingTensors.build([object()], [0], [0], V)


def test_rows_can_be_placed_anywhere_among_the_padding():
    """``row_index``: the engine builds one tensor set for every device's rows at their places (device d's rows
    start at d * S); the rows not named are padding, and errors name the entry of ``params_list``."""
    hot = SamplingParams(temperature=0.7, top_k=3, min_tokens=2, stop_token_ids=[9])
    st = SamplingTensors.build(
        [hot, hot], [5, 6], [4, 7], 16, num_rows=6, row_index=[1, 4], eos_token_ids=[2]
    )
    np.testing.assert_array_equal(st.temperature, np.float32([0, 0.7, 0, 0, 0.7, 0]))
    np.testing.assert_array_equal(st.top_k, [16, 3, 16, 16, 3, 16])
    np.testing.assert_array_equal(st.position, [0, 4, 0, 0, 7, 0])
    np.testing.assert_array_equal(st.seed[:, 0], [0, 5, 0, 0, 6, 0])
    np.testing.assert_array_equal(st.masked_ids, [[-1, -1], [2, 9], [-1, -1], [-1, -1], [2, 9], [-1, -1]])
    stacked = st.reshape_rows(2, 3)
    assert stacked.temperature.shape == (2, 3) and stacked.seed.shape == (2, 3, 2)
    with pytest.raises(ValueError, match="row_index repeats a row"):
        SamplingTensors.build([hot, hot], [5, 6], [4, 7], 16, num_rows=6, row_index=[1, 1])
    with pytest.raises(ValueError, match=r"row_index\[1\] = 6 must be in \[0, 5\]"):
        SamplingTensors.build([hot, hot], [5, 6], [4, 7], 16, num_rows=6, row_index=[1, 6])
    with pytest.raises(ValueError, match=r"params_list\[1\]\.top_k = -3"):
        SamplingTensors.build([hot, Row(top_k=-3)], [5, 6], [4, 7], 16, num_rows=6, row_index=[3, 0])
