"""Lineage plot of a run (PNG): weighted latency of every version against its step.

Verified versions are dots, failed ones red crosses on a band above the chart (they have
no latency), parent edges grey, the best version's lineage bold, branch merges dashed.
A run timed with the simulated timer is titled SIMULATED.
"""
from __future__ import annotations

__all__ = ["plot_lineage"]


def plot_lineage(store, run_name: str, path: str) -> str:
    import matplotlib  # optional dependency (matplotlib): imported only on this path
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (matplotlib): imported only on this path

    run = store.run(run_name)
    vs = {v.id: v for v in store.versions(run.id)}
    lat = {i: v.weighted_latency_us for i, v in vs.items() if v.weighted_latency_us}
    top = max(lat.values()) * 1.15 if lat else 1.0
    y = {i: lat.get(i, top) for i in vs}
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for e in store.edges(run.id):
        if e.parent_id in vs and e.child_id in vs:
            ax.plot([vs[e.parent_id].step, vs[e.child_id].step], [y[e.parent_id], y[e.child_id]],
                    ls="--" if e.relation == "merge" else "-", color="0.75", lw=0.8, zorder=1)
    best_chain = store.lineage(run.best_version) if run.best_version else []
    if len(best_chain) > 1:
        ax.plot([vs[i].step for i in best_chain], [y[i] for i in best_chain], color="tab:green", lw=2.2, zorder=2,
                label="best lineage")
    ok = [v for v in vs.values() if v.status == "verified"]
    bad = [v for v in vs.values() if v.status == "failed"]
    ax.scatter([v.step for v in ok], [y[v.id] for v in ok], s=22, color="tab:blue", zorder=3, label="verified")
    ax.scatter([v.step for v in bad], [y[v.id] for v in bad], s=30, marker="x", color="tab:red", zorder=3,
               label="failed a check (evidence)")
    if run.best_version in vs:
        b = vs[run.best_version]
        ax.scatter([b.step], [y[b.id]], s=120, marker="*", color="gold", edgecolor="k", zorder=4, label="best")
    final = next((d for d in reversed(store.decisions(run.id)) if d.action == "stop"), None)
    sp = final.data.get("speedup") if final else None
    title = f"{run.op} agent run '{run.name}': {len(vs)} versions"
    if sp:
        title += f", best {sp:.2f}x vs root (interleaved)"
    if run.timer == "simulated":
        title = "SIMULATED TIMER (not a measurement) - " + title
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("weighted latency (us)" + (" [simulated]" if run.timer == "simulated" else ""))
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
