from p2ptrain.bench.transport import measure_throughput, throughput_table


def test_the_transport_and_the_bare_stream_are_timed_on_the_same_daemons():
    results = measure_throughput([1], repeats=2, window=3)
    assert [(r.size_mib, r.pattern, r.repeats) for r in results] == [(1, "sequential", 2), (1, "streamed", 2)]
    for r in results:  # both moved every byte (the receiver checked each message); loopback moves >1 MB/s
        assert r.transport_mb_per_s > 1 and r.raw_stream_mb_per_s > 1
        assert r.ratio == r.transport_mb_per_s / r.raw_stream_mb_per_s
    table = throughput_table(results)
    assert "sequential" in table.splitlines()[2] and "streamed" in table.splitlines()[3]
