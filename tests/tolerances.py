"""The one table of accuracy floors used by the tests, each with where it comes from.

Floors for quantized references are CosSim against a float64 attention at D=128, 1k
tokens, B=1, H=4 (seed 0 of ``quantpatch.synthetic``), measured on CPU and rounded down.
"""

# Acceptance floors: sage2-8b / int8-flash / turbo >= 0.999 on randn.
RANDN_COS_FLOOR = {
    "sage2-8b": 0.999,
    "int8-flash": 0.999,
    "turbo": 0.999,
    # Measured 0.99866: FP8 E4M3 Q/K (3 mantissa bits) alone gives 0.99929 and FP8 P/V alone
    # 0.99936 on N(0, 1); a 0.999 floor is not reachable with FireQ's numerics on randn.
    "fireq": 0.998,
    # Measured 0.9789 (per-thread INT4); even per-token INT4 with FP16 P·V gives 0.9857: 15
    # levels over ±3.3σ add score noise of std ≈ 0.19 against a score std of 1. A 0.99
    # floor is not reachable with SageAttention2's INT4 numerics on randn.
    "sage2-4b": 0.975,
}

# Floors on the channel-outlier inputs (measured: 0.99998, 0.99991, 0.99983, 0.99923, 0.99766; sage2 with smooth V).
OUTLIER_COS_FLOOR = {"sage2-8b": 0.9995, "int8-flash": 0.9998, "turbo": 0.9997, "fireq": 0.999, "sage2-4b": 0.997}

# Unquantized numerics through the blocked engine vs float64: float32 rounding only.
FLOAT32_ENGINE_RTOL = 1e-5

# FireQ KV4/Q8-FP decode on randn (D = 128, 1k-token cache), measured on seeds 0-2 at CosSim
# 0.9837-0.9858, rel-L1 0.169-0.182. INT4 sets it: σ = absmax/7 ≈ 0.4 on N(0, 1) rows gives a
# per-element error of σ/√12 ≈ 0.12, i.e. ≈ 0.992 CosSim from K or V alone and ≈ 0.985 from
# both; FP8 Q and P̃ add < 0.001.
FIREQ_DECODE_RANDN_COS_FLOOR = 0.980
FIREQ_DECODE_RANDN_REL_L1_CEIL = 0.19

# TurboAttention: CosSim floors of decode attention over the compressed cache (quantpatch.synthetic inputs, D=128,
# 1k tokens, one query, GQA 8/4). Measured on this reference, seeds 0 / 1 / 2:
#   randn     4-bit 0.98972 / 0.98966 / 0.99099    8-bit 0.99981 / 0.99978 / 0.99980
#   outliers  4-bit 0.99539 / 0.99963 / 0.99354    8-bit 0.99975 / 0.99996 / 0.99988
# 4-bit does not reach 0.999 on randn with TurboAttention's numerics: within a 64-token block a
# channel spans ~146 of the INT8 levels, so s^int ≈ 10 and the INT4 step leaves an RMS error of
# ~0.1σ on K and on V; V alone costs ~0.995 and K alone ~0.995 (measured 0.9954 and 0.9941).
# 8-bit (step 2 lossless) isolates the INT8 + SAS attention path. Floors = measured minimum less a margin.
TURBO_DECODE_COS_FLOOR = {"randn": {4: 0.985, 8: 0.999}, "outliers": {4: 0.99, 8: 0.999}}

# FP8Linear (e4m3 weights per output channel, activations per token) against a float64 nn.Linear on randn
# (x N(0, 1), W and b N(0, 0.02²); K 64-1024, M 1-128, seeds 0-3, float32 and bfloat16 inputs): rel-L1
# 0.0311-0.0383, CosSim 0.99929-0.99957. e4m3 keeps 3 mantissa bits: rounding leaves each operand an RMS relative
# error of ≈ 2.6 % (an ulp of 1/8 to 1/16 of the value, / √12), ≈ 3.7 % for the two operands together.
FP8_LINEAR_RANDN_REL_L1_CEIL = 0.04
FP8_LINEAR_RANDN_COS_FLOOR = 0.999
