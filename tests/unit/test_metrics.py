import numpy as np

from gpupool_sched.simulate.metrics import allocation_curve


def test_curve_averages_events_by_rounded_arrived_percentage():
    # 10 GPUs = 10,000 milli; events at arrived 0, 5%, 10.4% (rounds to 10), 10.6% (rounds to 11)
    arrived = np.array([0, 500, 1040, 1060])
    used = np.array([0, 500, 1000, 1000])
    curve = allocation_curve(arrived, used, total_gpus=10)
    assert curve[0] == 0.0 and curve[5] == 5.0 and curve[10] == 10.0 and curve[11] == 10.0
    # 4% has no event of its own: the mean over 3..5% is used
    assert curve[4] == 5.0
    # nothing near 50%
    assert 50 not in curve


def test_curve_uses_the_mean_of_all_events_at_one_point():
    arrived = np.array([1000, 1000, 1000])
    used = np.array([900, 1000, 950])
    assert allocation_curve(arrived, used, total_gpus=10)[10] == 9.5
