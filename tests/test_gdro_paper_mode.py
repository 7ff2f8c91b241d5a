"""The paper setting reproduces the pre-change controllers exactly (issue: "GDRO that does what
the paper describes", item 4).

REF was produced by running the three scenario functions below on the pre-change code (commit
64e7eea, branch wip/gdro, before any of the mode switches existed) with that code's default
configs, i.e. the same configs as here without ``mode="paper"``, and writing the outputs with
``pprint`` (floats are the float32 results as Python floats). Bit-exact under XLA:CPU's default
flags; the test session compiles at LLVM -O0 (tests/conftest.py), which rounds a few float32
results in the last bit or two, so floats are compared to 1e-6 relative (integers and bins
exactly): any change of the controllers' behaviour is orders of magnitude larger.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import gdro


def classifier_scenario(cfg, steps=8, num_prompts=12, per_step=6, n=4, seed=0):
    rng = np.random.default_rng(seed)
    s = gdro.classifier_init(cfg, num_prompts)
    bins_seen = []
    for _ in range(steps):
        ids = rng.choice(num_prompts, per_step, replace=False).astype(np.int32)
        ids[-1] = ids[0]  # one duplicate id per step
        correct = rng.random(per_step * n) < rng.uniform(0.05, 0.95, per_step).repeat(n)
        seg = jnp.asarray(np.repeat(np.arange(per_step), n), jnp.int32)
        bins_seen.append(np.asarray(gdro.classify(cfg, s, jnp.asarray(ids))).tolist())
        out = gdro.visit_outcome(cfg, jnp.asarray(correct), seg, per_step)
        s = gdro.classifier_update(cfg, s, jnp.asarray(ids), out)
    all_ids = jnp.arange(num_prompts)
    bins = gdro.classify(cfg, s, all_ids)
    return dict(
        bins_seen=bins_seen,
        p_hat=np.asarray(gdro.success_estimate(cfg, s, all_ids)).tolist(),
        bins=np.asarray(bins).tolist(),
        bin_success=np.asarray(gdro.bin_success(cfg, s, all_ids, bins)).tolist(),
    )


def prompt_gdro_scenario(cfg, steps=4, num_bins=10, r=24, seed=1):
    rng = np.random.default_rng(seed)
    s = gdro.prompt_gdro_init(cfg, num_bins)
    weights, q_used = [], []
    for _ in range(steps):
        bins = jnp.asarray(rng.integers(0, num_bins, r), jnp.int32)
        correct = jnp.asarray(rng.random(r) < 0.5)
        per_rollout = jnp.asarray(rng.normal(0, 0.3, r), jnp.float32)
        weights.append(np.asarray(gdro.prompt_gdro_weights(cfg, s, bins)).tolist())
        sig = gdro.loss_signal(cfg, per_rollout_loss=per_rollout, correct=correct)
        s, diag = gdro.prompt_gdro_update(cfg, s, bins, sig)
        q_used.append(np.asarray(diag["gdro/q"]).tolist())
    return dict(weights=weights, q_used=q_used, score=np.asarray(s.score).tolist())


def rollout_gdro_scenario(cfg, steps=6, num_bins=10, p=8, seed=2):
    rng = np.random.default_rng(seed)
    s = gdro.rollout_gdro_init(cfg, num_bins)
    alloc_n = []
    for _ in range(steps):
        bins = rng.integers(0, num_bins, p).astype(np.int32)
        success = rng.random(num_bins).astype(np.float32)
        ids = rng.permutation(100)[:p].astype(np.int32)
        a = gdro.allocate(cfg, s, bins, success, prompt_ids=ids)
        alloc_n.append(np.asarray(a.rollouts_per_prompt).tolist())
        r = int(np.asarray(a.rollouts_per_prompt).sum())
        rewards = (rng.random(r) < 0.5).astype(np.float32)
        sig = gdro.loss_signal(
            cfg,
            per_rollout_loss=rng.normal(0, 0.5, r).astype(np.float32),
            correct=rewards > 0.5,
        )
        s, _ = gdro.rollout_gdro_update(
            cfg, s, a, bins, sig, rewards, a.segment_ids, bin_success=success
        )
    return dict(alloc_n=alloc_n, scores=np.asarray(s.scores).tolist(), mu=float(s.mu))


REF = {
    "cls_any_d0": {
        "bin_success": [0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.75, 0.800000011920929, 1.0],
        "bins": [5, 8, 9, 8, 9, 9, 0, 9, 9, 9, 7, 8],
        "bins_seen": [
            [0, 0, 0, 0, 0, 0],
            [0, 9, 0, 0, 0, 0],
            [0, 0, 0, 9, 9, 0],
            [9, 9, 9, 9, 9, 9],
            [5, 5, 5, 9, 9, 5],
            [9, 0, 6, 6, 9, 9],
            [5, 9, 9, 7, 6, 5],
            [9, 6, 9, 9, 0, 9],
        ],
        "p_hat": [
            0.5,
            0.800000011920929,
            1.0,
            0.800000011920929,
            1.0,
            1.0,
            0.0,
            1.0,
            1.0,
            1.0,
            0.75,
            0.800000011920929,
        ],
    },
    "cls_any_d003": {
        "bin_success": [
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.6666666865348816,
            0.800000011920929,
            0.0,
            1.0,
        ],
        "bins": [9, 9, 9, 9, 7, 9, 9, 9, 6, 9, 9, 9],
        "bins_seen": [
            [0, 0, 0, 0, 0, 0],
            [0, 9, 0, 9, 0, 0],
            [4, 0, 0, 0, 9, 4],
            [9, 9, 0, 0, 3, 9],
            [9, 9, 4, 9, 9, 9],
            [9, 9, 5, 9, 9, 9],
            [9, 9, 9, 7, 9, 9],
            [9, 9, 9, 9, 9, 9],
        ],
        "p_hat": [
            1.0,
            1.0,
            1.0,
            1.0,
            0.800000011920929,
            1.0,
            1.0,
            1.0,
            0.6666666865348816,
            1.0,
            1.0,
            1.0,
        ],
    },
    "cls_passk": {
        "bin_success": [
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.5,
            0.6466666460037231,
            0.75,
            0.8333333134651184,
            0.9722222089767456,
        ],
        "bins": [7, 9, 6, 9, 0, 5, 6, 5, 6, 8, 6, 6],
        "bins_seen": [
            [0, 0, 0, 0, 0, 0],
            [5, 5, 0, 0, 0, 5],
            [0, 0, 2, 9, 9, 0],
            [7, 9, 9, 9, 8, 7],
            [8, 8, 9, 5, 9, 8],
            [0, 6, 9, 5, 5, 0],
            [7, 7, 6, 9, 5, 7],
            [6, 9, 5, 3, 7, 6],
        ],
        "p_hat": [
            0.75,
            0.9444444179534912,
            0.6000000238418579,
            1.0,
            0.0,
            0.5,
            0.6666666865348816,
            0.5,
            0.6666666865348816,
            0.8333333134651184,
            0.6333333253860474,
            0.6666666865348816,
        ],
    },
    "pg_failure": {
        "q_used": [
            [
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
            ],
            [
                0.0035949531011283398,
                0.013348226435482502,
                0.0032733408734202385,
                0.0014931652694940567,
                0.019985515624284744,
                0.0,
                0.0032733408734202385,
                0.0014931652694940567,
                0.9335528016090393,
                0.019985515624284744,
            ],
            [
                0.025831814855337143,
                0.02196706086397171,
                0.022979259490966797,
                0.001826765830628574,
                0.14893396198749542,
                0.03733443468809128,
                0.005384603515267372,
                0.0017354784067720175,
                0.7049909234046936,
                0.02901572547852993,
            ],
            [
                0.02713611349463463,
                0.01590457558631897,
                0.01653124950826168,
                0.0019709428306668997,
                0.5378654599189758,
                0.03143758699297905,
                0.010628445073962212,
                0.0,
                0.32692983746528625,
                0.03159569576382637,
            ],
        ],
        "score": [
            5.07611083984375,
            4.106560707092285,
            4.367530345916748,
            0.4593919813632965,
            9.173503875732422,
            5.6031999588012695,
            4.834218502044678,
            0.5399999618530273,
            8.177663803100586,
            4.970239639282227,
        ],
        "weights": [
            [
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
            ],
            [
                0.42991018295288086,
                0.07041312009096146,
                0.07041312009096146,
                0.42991018295288086,
                0.42991018295288086,
                0.07041312009096146,
                0.03211960941553116,
                0.07041312009096146,
                0.07041312009096146,
                0.2871348559856415,
                0.2871348559856415,
                0.07041312009096146,
                15.0,
                0.07041312009096146,
                0.42991018295288086,
                0.03211960941553116,
                0.03211960941553116,
                0.03211960941553116,
                0.07733134925365448,
                0.2871348559856415,
                0.2871348559856415,
                0.03211960941553116,
                0.2871348559856415,
                0.03211960941553116,
            ],
            [
                0.022658763453364372,
                8.744537353515625,
                0.28502920269966125,
                0.022658763453364372,
                0.3204115927219391,
                0.021526455879211426,
                0.4630873203277588,
                0.022658763453364372,
                0.35990408062934875,
                0.4630873203277588,
                0.35990408062934875,
                0.021526455879211426,
                0.4630873203277588,
                0.4630873203277588,
                0.28502920269966125,
                0.06678932160139084,
                0.021526455879211426,
                0.06678932160139084,
                1.8473409414291382,
                0.3204115927219391,
                0.021526455879211426,
                0.3204115927219391,
                8.744537353515625,
                0.27247413992881775,
            ],
            [
                0.32910338044166565,
                0.28265199065208435,
                0.16566337645053864,
                0.172190859913826,
                0.172190859913826,
                3.4053280353546143,
                0.020529503002762794,
                0.16566337645053864,
                0.020529503002762794,
                0.11070676147937775,
                5.602450847625732,
                0.172190859913826,
                0.16566337645053864,
                0.28265199065208435,
                5.602450847625732,
                0.16566337645053864,
                0.3274565041065216,
                0.11070676147937775,
                0.020529503002762794,
                0.3274565041065216,
                0.28265199065208435,
                0.3274565041065216,
                0.16566337645053864,
                5.602450847625732,
            ],
        ],
    },
    "pg_surrogate": {
        "q_used": [
            [
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
                0.10000000149011612,
            ],
            [
                0.2096881866455078,
                0.001768162357620895,
                0.12220333516597748,
                0.0,
                0.2762247920036316,
                0.0,
                0.004765646066516638,
                0.06984497606754303,
                0.13331182301044464,
                0.18219320476055145,
            ],
            [
                0.15468600392341614,
                0.0016006991500034928,
                0.11616720259189606,
                0.0898074135184288,
                0.20046605169773102,
                0.08328591287136078,
                0.005248791538178921,
                0.06259114295244217,
                0.12270517647266388,
                0.1634417027235031,
            ],
            [
                0.16392698884010315,
                0.0,
                0.10653573274612427,
                0.09014099836349487,
                0.1934015154838562,
                0.0825289785861969,
                0.007846439257264137,
                0.05025535076856613,
                0.06203697249293327,
                0.2433270663022995,
            ],
        ],
        "score": [
            0.9152918457984924,
            -7.123123645782471,
            -0.3540153503417969,
            -0.7153764367103577,
            0.2815505862236023,
            -0.8804981708526611,
            -3.9048047065734863,
            -1.4060343503952026,
            -1.3445265293121338,
            0.7007960081100464,
        ],
        "weights": [
            [
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
            ],
            [
                0.03548869490623474,
                0.9100207090377808,
                1.356751799583435,
                1.5615007877349854,
                0.9927431344985962,
                0.03548869490623474,
                0.9100207090377808,
                0.520119845867157,
                2.0569839477539062,
                0.9927431344985962,
                1.356751799583435,
                0.9100207090377808,
                2.0569839477539062,
                0.9100207090377808,
                0.03548869490623474,
                0.03548869490623474,
                0.9927431344985962,
                0.9927431344985962,
                1.356751799583435,
                1.356751799583435,
                0.9927431344985962,
                0.013167107477784157,
                1.5615007877349854,
                2.0569839477539062,
            ],
            [
                1.1942622661590576,
                0.8562246561050415,
                2.0609004497528076,
                1.2614762783050537,
                0.053960442543029785,
                0.6434711217880249,
                0.8562246561050415,
                0.9232692718505859,
                1.1942622661590576,
                2.0609004497528076,
                0.8562246561050415,
                0.9232692718505859,
                0.016456061974167824,
                0.016456061974167824,
                1.5902565717697144,
                1.1942622661590576,
                2.0609004497528076,
                1.1942622661590576,
                0.016456061974167824,
                0.9232692718505859,
                0.6434711217880249,
                0.9232692718505859,
                1.6802699565887451,
                0.8562246561050415,
            ],
            [
                0.7862271070480347,
                0.4787665903568268,
                0.591006338596344,
                1.8424742221832275,
                0.4787665903568268,
                1.0149316787719727,
                1.8424742221832275,
                2.318098783493042,
                0.8587443828582764,
                1.5616798400878906,
                0.4787665903568268,
                0.8587443828582764,
                1.8424742221832275,
                2.318098783493042,
                0.8587443828582764,
                1.0149316787719727,
                1.0149316787719727,
                0.591006338596344,
                1.0149316787719727,
                0.07475050538778305,
                1.0149316787719727,
                0.591006338596344,
                0.4787665903568268,
                0.07475050538778305,
            ],
        ],
    },
    "rg_bandit": {
        "alloc_n": [
            [4, 4, 4, 4, 4, 4, 4, 4],
            [2, 6, 6, 2, 2, 6, 6, 2],
            [2, 2, 2, 10, 10, 2, 2, 2],
            [10, 2, 2, 2, 2, 2, 2, 10],
            [9, 3, 9, 3, 2, 2, 2, 2],
            [2, 6, 6, 2, 6, 6, 2, 2],
        ],
        "mu": 0.45093709230422974,
        "scores": [
            [
                0.27175647020339966,
                0.1767813265323639,
                -0.00576570350676775,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            [
                0.13958624005317688,
                0.0,
                -0.07133378833532333,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            [
                0.17588110268115997,
                0.0,
                -0.05888650193810463,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            [
                0.04823525995016098,
                0.0,
                0.0,
                0.0,
                -0.010023568756878376,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            [
                -0.3137664794921875,
                0.0,
                -0.0007952481973916292,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            [0.6633748412132263, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.07276309281587601, 0.0, 0.0, 0.0],
            [
                0.01442266721278429,
                0.0,
                0.0,
                0.0,
                -0.07885415107011795,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            [
                0.18937404453754425,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                -0.07012303173542023,
                0.0,
                0.0,
            ],
            [
                -0.14535760879516602,
                0.2603099048137665,
                0.11678734421730042,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            [0.16300083696842194, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        ],
    },
    "rg_bandit_fail": {
        "alloc_n": [
            [4, 4, 4, 4, 4, 4, 4, 4],
            [2, 10, 2, 2, 2, 2, 2, 10],
            [6, 6, 3, 6, 3, 3, 3, 2],
            [8, 3, 3, 3, 2, 8, 2, 3],
            [4, 7, 7, 3, 2, 3, 2, 4],
            [5, 5, 2, 5, 4, 3, 3, 5],
        ],
        "mu": 0.47571730613708496,
        "scores": [
            [0.6000000238418579, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [
                0.6000000238418579,
                0.6000000238418579,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.27000001072883606,
                0.0,
                0.0,
            ],
            [
                0.6000000238418579,
                0.6800000071525574,
                0.30000001192092896,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            [
                0.30000001192092896,
                0.03200000151991844,
                0.25,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            [
                0.45000001788139343,
                0.0,
                0.45000001788139343,
                0.0,
                0.1666666865348816,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            [
                0.6000000238418579,
                0.40000003576278687,
                0.30000001192092896,
                0.36000001430511475,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            [
                0.6000000238418579,
                0.40000003576278687,
                0.30000001192092896,
                0.06000000238418579,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
            [0.30000001192092896, 0.40000003576278687, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.30000001192092896, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [
                0.30000001192092896,
                0.0,
                0.15000000596046448,
                0.0,
                0.0,
                0.2571428716182709,
                0.1875,
                0.0,
                0.0,
                0.0,
                0.0,
            ],
        ],
    },
    "rg_sqrt": {
        "alloc_n": [
            [5, 4, 4, 4, 5, 4, 4, 2],
            [4, 3, 5, 3, 4, 4, 4, 5],
            [4, 3, 4, 5, 3, 4, 4, 5],
            [4, 4, 4, 4, 4, 4, 4, 4],
            [4, 3, 3, 5, 5, 4, 3, 5],
            [5, 3, 5, 5, 4, 3, 3, 4],
        ],
        "mu": 0.0,
        "scores": [
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        ],
    },
}


def assert_same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(
            np.asarray(got[k], np.float32), np.asarray(want[k], np.float32), rtol=1e-6, err_msg=k
        )


PAPER_CLS = {
    "cls_any_d003": (dict(history=5, delta=0.03), 0),
    "cls_any_d0": (dict(history=5, delta=0.0), 3),
    "cls_passk": (dict(history=5, delta=0.0, statistic="pass_at_k", pass_k=2), 4),
}


@pytest.mark.parametrize("name", sorted(PAPER_CLS))
def test_paper_classifier_reproduces_pre_change_numbers(name):
    kwargs, seed = PAPER_CLS[name]
    cfg = gdro.ClassifierConfig(mode="paper", **kwargs)
    assert cfg.statistic == kwargs.get("statistic", "any_correct") and not cfg.separate_unseen
    assert_same(classifier_scenario(cfg, seed=seed), REF[name])


@pytest.mark.parametrize(
    "name, kwargs, seed",
    [("pg_surrogate", {}, 1), ("pg_failure", dict(signal="failure_rate"), 5)],
)
def test_paper_prompt_gdro_reproduces_pre_change_numbers(name, kwargs, seed):
    cfg = gdro.PromptGDROConfig(mode="paper", **kwargs)
    assert cfg.share_division and not cfg.renormalise_informative
    assert_same(prompt_gdro_scenario(cfg, seed=seed), REF[name])


@pytest.mark.parametrize(
    "name, kwargs, seed",
    [
        ("rg_bandit", {}, 2),
        ("rg_bandit_fail", dict(signal="failure_rate"), 6),
        ("rg_sqrt", dict(allocator="sqrt"), 7),
    ],
)
def test_paper_rollout_gdro_reproduces_pre_change_numbers(name, kwargs, seed):
    cfg = gdro.RolloutGDROConfig(mode="paper", **kwargs)
    assert cfg.feedback == "loss" and not cfg.count_weighted_dp
    assert_same(rollout_gdro_scenario(cfg, seed=seed), REF[name])


def test_default_mode_differs_from_paper_on_the_same_inputs():
    # The regression inputs are sensitive: the corrected default gives other numbers.
    cls = classifier_scenario(gdro.ClassifierConfig(history=5, delta=0.0), seed=3)
    assert cls["bins_seen"][0] == [10] * 6  # unseen marker B = 10, not bin 0
    assert cls["p_hat"] != REF["cls_any_d0"]["p_hat"]
    pg = prompt_gdro_scenario(gdro.PromptGDROConfig(), seed=1)
    assert pg["score"] != REF["pg_surrogate"]["score"]
    rg = rollout_gdro_scenario(gdro.RolloutGDROConfig(), seed=2)
    assert rg["scores"] != REF["rg_bandit"]["scores"]


def test_paper_configs_flip_every_switch_and_explicit_fields_win():
    c, p, r = gdro.paper_configs()
    assert (c.mode, c.statistic, c.separate_unseen, c.unseen_index) == (
        "paper",
        "any_correct",
        False,
        0,
    )
    assert (p.signal, p.share_division, p.renormalise_informative) == (
        "surrogate_loss",
        True,
        False,
    )
    assert (r.signal, r.feedback, r.count_weighted_dp) == ("surrogate_loss", "loss", False)
    c, p, r = gdro.paper_configs({"statistic": "success_rate"}, {"share_division": False})
    assert c.statistic == "success_rate" and not c.separate_unseen and not p.share_division
    d = (gdro.ClassifierConfig(), gdro.PromptGDROConfig(), gdro.RolloutGDROConfig())
    assert (d[0].statistic, d[0].separate_unseen, d[0].unseen_index) == ("success_rate", True, 10)
    assert (d[1].signal, d[1].share_division, d[1].renormalise_informative) == (
        "failure_rate",
        False,
        True,
    )
    assert (d[2].signal, d[2].feedback, d[2].count_weighted_dp) == (
        "failure_rate",
        "variance",
        True,
    )
    for cls in (gdro.ClassifierConfig, gdro.PromptGDROConfig, gdro.RolloutGDROConfig):
        with pytest.raises(ValueError, match="mode"):
            cls(mode="verl")
        assert cls(mode="paper") == cls(mode="paper") and hash(cls(mode="paper"))
