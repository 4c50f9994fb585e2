"""How outputs travel from the engine's receiving thread to a response (serve/streams.py): merged
when they arrive faster than the event loop takes them, and the loop woken once per burst, or once
per request that is not streamed."""

import asyncio


def test_outputs_arriving_faster_than_the_loop_takes_them_merge_into_one_chunk():
    """The engine's thread appends outputs; the event loop, woken once for the burst, takes
    everything since its last look as one output (text and tokens joined in order, the last
    one's finish reason and counts), so a stream under load sends fewer, fuller chunks."""
    from serve.engine import Output
    from serve.streams import Outbox, Outputs

    async def main():
        outbox = Outbox(asyncio.get_running_loop())
        outputs = Outputs(outbox)
        pieces = [Output("a", [1], None, 3, 1), Output("bc", [2], None, 3, 2), Output("", [3], "length", 3, 3)]
        await asyncio.to_thread(lambda: [outputs.put(out) for out in pieces])
        merged = await asyncio.wait_for(outputs.take(), timeout=5)
        assert (merged.text, merged.token_ids, merged.finish_reason, merged.completion_tokens) == (
            "abc", [1, 2, 3], "length", 3)
        assert not outputs.items and outputs.done
        later = Output("d", [4], None, 3, 4)
        outputs = Outputs(outbox)
        await asyncio.to_thread(outputs.put, later)
        assert await asyncio.wait_for(outputs.take(), timeout=5) == later  # one output: itself
        assert not outputs.done

    asyncio.run(main())


def test_a_request_that_is_not_streamed_wakes_the_loop_once_by_its_last_output():
    """each=False: outputs before the last wake nothing (no call into the loop per engine step);
    the last wakes the request, which takes the whole answer at once."""
    from serve.engine import Output
    from serve.streams import Outbox, Outputs

    async def main():
        outbox = Outbox(asyncio.get_running_loop())
        woken = []
        outbox.deliver = lambda deliver=outbox.deliver: (woken.append(1), deliver())
        outputs = Outputs(outbox, each=False)
        await asyncio.to_thread(lambda: [outputs.put(Output(t, [i], None, 2, i + 1)) for i, t in enumerate("abc")])
        await asyncio.sleep(0.05)
        assert not woken and not outputs.ready.is_set()
        await asyncio.to_thread(outputs.put, Output("d", [3], "length", 2, 4))
        merged = await asyncio.wait_for(outputs.take(), timeout=5)
        assert (merged.text, merged.token_ids, merged.finish_reason) == ("abcd", [0, 1, 2, 3], "length")
        assert woken == [1]

    asyncio.run(main())


def test_a_request_that_is_not_streamed_gets_its_whole_answer_when_parts_came_before_it_looked():
    """each=False, under load: outputs that arrived before the request first takes are not its
    answer; take waits for the last and returns everything, finish reason included."""
    from serve.engine import Output
    from serve.streams import Outbox, Outputs

    async def main():
        outputs = Outputs(Outbox(asyncio.get_running_loop()), each=False)
        outputs.put(Output("ab", [0, 1], None, 2, 2))  # before the handler's first take
        taking = asyncio.ensure_future(outputs.take())
        await asyncio.sleep(0.05)
        assert not taking.done()
        await asyncio.to_thread(outputs.put, Output("c", [2], "stop", 2, 3))
        merged = await asyncio.wait_for(taking, timeout=5)
        assert (merged.text, merged.token_ids, merged.finish_reason) == ("abc", [0, 1, 2], "stop") and outputs.done

    asyncio.run(main())
