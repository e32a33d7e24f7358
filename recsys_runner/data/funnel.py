"""A funnel over label tasks (``data.funnel``): binary labels in order, each later one positive only on rows where the one
before it is (a conversion is counted only after its click).

:func:`check_funnel` checks the key against the data's labels (the config's ``data.labels``, then the schema the files
gave); :data:`FUNNEL_WHY` ends the message of a row that breaks it, which the row encoder
(:class:`~recsys_runner.data.encoding.rows.Encoder`'s ``funnel``) finds as the files are read. ``model=esmm`` declares the
funnel through its data needs. May import ``errors`` only.
"""

from __future__ import annotations

from recsys_runner.errors import require

FUNNEL_WHY = ("; a conversion is counted only after its click (mis-joined labels?), and model=esmm, which sets data.funnel from "
              "model.click_label and model.conversion_label, cannot fit one without (pCTCVR = pCTR x pCVR) unless "
              "model.conversion_without_click=and, which trains it on click AND conversion (such rows count as not converted, "
              "data.funnel stays null)")
"""The end of a bad row's message when it breaks ``data.funnel`` (:class:`~recsys_runner.data.encoding.rows.Encoder`'s
``funnel_why``): why a funnel holds and what to do about the row."""


def check_funnel(funnel: list[str] | None, labels: dict[str, str] | None, label_kinds: dict[str, str] | None) -> None:
    """``data.funnel``: two or more distinct tasks; with ``labels`` known (task name → column: ``data.labels``, or the
    schema the files gave), each of them a binary task there.

    Raises:
        ConfigError: naming ``data.funnel``, what is wrong and the fix.
    """
    if funnel is None:
        return
    names = list(funnel)
    require(len(names) >= 2 and len(set(names)) == len(names),
            f"data.funnel={names} must name two or more distinct label tasks in funnel order, e.g. data.funnel=[ctr,cvr] (a "
            f"conversion only after a click). Fix: data.funnel=[<click task>,<conversion task>], or null")
    if labels is None:
        return
    missing = [t for t in names if t not in labels]
    require(not missing, f"data.funnel={names} names task(s) {missing} that the data's labels lack (its label tasks: {list(labels)}); "
            f"model=esmm sets data.funnel to [model.click_label, model.conversion_label]. Fix: give the data those labels, "
            f"data.labels={{{', '.join(f'{t}: <column>' for t in names)}}} (task name -> column), or name tasks of its labels "
            f"(model.click_label, model.conversion_label; or data.funnel)")
    kinds = label_kinds or {}
    wrong = {t: kinds[t] for t in names if kinds.get(t, "binary") != "binary"}
    require(not wrong, f"data.funnel={names} holds tasks that are not binary ({wrong}, data.label_kinds): a funnel's labels are "
            f"0/1 events, each positive only where the one before it is. Fix: data.funnel naming binary tasks, or null")
