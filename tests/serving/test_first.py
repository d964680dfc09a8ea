from __future__ import annotations

from pathlib import Path

from tests.testkit.serving import Scenario


async def test_blue_green(tmp_path: Path) -> None:
    async with Scenario(tmp_path) as sc:
        await sc.until(sc.serving_revision(1))
        async with sc.clients(8) as clients:
            await sc.ticks(3)
            rev = sc.write({"max_num_seqs": 5})
            await sc.until(sc.apply_ended(rev.id))
            await sc.ticks(2)
        print(sc.kinds())
        print(sc.describe(), len(clients.results), clients.failed[:3])
        assert sc.controller.apply.outcome == "applied"
        assert not clients.failed
        assert sc.longest_gap == 0
