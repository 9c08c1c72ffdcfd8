"""Plans made in one pass over the nodes in program order, keeping tied outputs equal to their inputs:
the cheapest given the choices upstream (`greedy`) and the fewest bytes (`_min_bytes_choice`)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from planner.ilp.problem import Problem
from planner.ilp.strategies import shard_bytes


def _in_program_order(problem: Problem, pick) -> tuple[int, ...]:
    """One strategy per distinct decision, nodes in program order: `pick(node, allowed, choice,
    done)` chooses for each representative node, where `allowed` are its strategies that keep tied
    outputs equal to inputs already chosen (possibly none); shared nodes copy their representative."""
    choice = [0] * len(problem.nodes)
    rep = problem.rep
    tied_out: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # by the decision of the output
    reachable: dict[int, list[tuple[int, int, set]]] = defaultdict(list)  # tied inputs: specs their outputs take
    for tin, tout in problem.ties:
        a, b = problem.owner[tin], problem.owner[tout]
        tied_out[rep[b]].append((tin, tout, b))
        reachable[rep[a]].append((tin, a, set(problem.nodes[b].owned[tout])))
    done: set[int] = set()
    for node in problem.nodes:
        r = rep[node.index]
        if r in done:
            choice[node.index] = choice[r]
            continue
        # Every node sharing this decision keeps its tied outputs equal to inputs already chosen,
        # and gives its tied inputs only specs their outputs can take.
        allowed = [i for i in range(node.size)
                   if not any(rep[problem.owner[tin]] in done
                              and problem.nodes[owner].owned[tout][i]
                              != problem.nodes[problem.owner[tin]].owned[tin][choice[rep[problem.owner[tin]]]]
                              for tin, tout, owner in tied_out[r])
                   and all(problem.nodes[owner].owned[tin][i] in specs for tin, owner, specs in reachable[r])]
        choice[node.index] = pick(node, allowed, choice, done)
        done.add(node.index)
    return tuple(choice)


def greedy(problem: Problem) -> tuple[int, ...]:
    """A quick feasible plan: nodes in program order, each taking the strategy that is cheapest
    given the choices already made upstream (own cost + resharding of its operands), restricted to
    keep tied outputs equal to their inputs. Used as the solver's starting hint and as the answer
    of last resort when the solver finds nothing in its time limit."""
    incoming: dict[int, list] = defaultdict(list)
    for e in problem.edges:
        incoming[e.dst].append(e)

    def cheapest(node, allowed, choice, done) -> int:
        best, best_cost = 0, None
        for i in allowed:
            c = node.costs[i]
            for e in incoming[node.index]:
                if e.src in done:
                    c += problem.edge_time(e.tensor, e.src_specs[choice[e.src]], e.dst_specs[i], e.op)
            if best_cost is None or c < best_cost:
                best, best_cost = i, c
        return best

    return _in_program_order(problem, cheapest)


def _ties_hold(problem: Problem, choice: Sequence[int]) -> bool:
    """Whether every tied output keeps its input's layout under `choice`."""
    return all(problem.spec(a, choice) == problem.spec(b, choice) for a, b in problem.ties)


def _min_bytes_choice(problem: Problem) -> tuple[int, ...]:
    """Per distinct decision, the strategy whose owned tensors take the fewest bytes (ties broken
    by the lower cost); tied outputs follow their inputs where they can."""
    mesh = problem.cost.mesh

    def fewest_bytes(node, allowed, choice, done) -> int:
        size = [sum(shard_bytes(problem.graph.tensors[t], specs[i], mesh) for t, specs in node.owned.items())
                for i in range(node.size)]
        return min(allowed or range(node.size), key=lambda i: (size[i], node.costs[i]))

    return _in_program_order(problem, fewest_bytes)
