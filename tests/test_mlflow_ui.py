"""The MLflow UI as a person sees it: a real ``mlflow server`` on loopback, a 3-point sweep, an evaluate and an export
logged into it by the runner, and Debian's ``chromium`` (headless, driven by Selenium) on the URL the runner prints.

One server, one sweep, one browser for the module; each test is one thing a user looks for (issue 33). Screenshots go
to the module's tmp dir and, when ``RECSYS_UI_SCREENSHOTS=<dir>`` is set, there too (``docs/images`` is made so).
Without chromium and chromedriver the module skips and says that ``.ci/install-chromium`` installs them; under
``CI=true`` it fails instead: a skip is not a pass.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import run_in_process, skip_unless_ci
from tests.test_mlflow_model import _click_rows
from tests.test_tracking import MlflowServer

pytestmark = pytest.mark.slow

EXPERIMENT = "ui_browser"
LRS = ("0.01", "0.05", "0.1")
WAIT_S = 60  # a first page load compiles MLflow's bundle in a cold browser; later waits are seconds
CHROME_FLAGS = (
    # no background traffic: without these chromium floods a closed network with refused connections
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
)
WINDOW = (1600, 1000)
RUN_NAME_COL = "attributes.`Run Name`"
DATASET_COL = "attributes.`Dataset`"
SWEPT_COL = "params.`swept.optim.lr`"
AUC_COL = "metrics.`eval/auc`"
MODELS_COL = "attributes.`Models`"


def _browser_binaries() -> tuple[str, str]:
    """Debian's chromium and its chromedriver, or the module skips (fails under CI) saying how to get them."""
    chromium = shutil.which("chromium") or ("/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None)
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.access("/usr/bin/chromedriver", os.X_OK) else None)
    missing = [name for name, path in (("chromium", chromium), ("chromedriver", driver)) if path is None]
    if missing:
        reason = (f"BROWSER TEST SKIPPED — {' and '.join(missing)} not found; `.ci/install-chromium` (run by `make test`) "
                  "installs Debian's chromium and chromium-driver as root with apt-get")
        skip_unless_ci(reason)
    assert chromium and driver
    return chromium, driver


@pytest.fixture(scope="module")
def browser_binaries() -> tuple[str, str]:
    return _browser_binaries()


@pytest.fixture(scope="module")
def mlflow_server(browser_binaries: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``mlflow server`` on 127.0.0.1 at a free port (sqlite store, artifacts in tmp), stopped by its process group's id
    at the end (:class:`tests.test_tracking.MlflowServer`); its URI."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    server.start(timeout_s=120)
    try:
        yield server.uri
    finally:
        server.stop()


@dataclass
class Logged:
    """What the runner logged into the server: the experiment, the sweep's parent, its children, the evaluate run."""

    uri: str
    experiment_id: str
    parent: Any
    children: list[Any]
    trained: Any  # the child the evaluate run loaded (the sweep's best)
    evaluated: Any
    model_id: str  # the logged model of its export, whose source is ``trained``
    exported: Any  # the export run, also nested under ``trained``
    sweep_output: str


@pytest.fixture(scope="module")
def logged(mlflow_server: str, tmp_path_factory: pytest.TempPathFactory) -> Logged:
    """``python -m recsys_runner -m optim.lr=…`` (3 points) and ``python -m recsys_runner.evaluate load=<best child>``
    into the server, each run in this process as ``python -m`` runs it (the same commands without ~10 s of imports)."""
    cwd = tmp_path_factory.mktemp("runs")
    tracking = [f"tracking.uri={mlflow_server}", f"tracking.experiment={EXPERIMENT}"]
    header = "click,user,item,price,tags"  # a file, not generated data: an export of it writes the MLflow model
    (cwd / "clicks.csv").write_text("\n".join([header, *_click_rows(np.random.default_rng(0), 1500, [f"u{k}" for k in range(40)])]) + "\n")
    data = ["data=csv", f"data.path={cwd}/clicks.csv", "data.batch_size=64", "data.label=click", "data.dense=[{name: price}]",
            "data.sparse=[{name: user}, {name: item}, {name: tags, separator: '|'}]", "distributed.device=cpu"]
    sweep = run_in_process([sys.executable, "-m", "recsys_runner", "-m", f"optim.lr={','.join(LRS)}", *data,
                            "train.num_steps=10", "train.log_every_steps=5", "train.eval_max_batches=4", *tracking], cwd)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    runs = client.search_runs([experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(LRS), [r.info.run_name for r in runs]
    trained = client.get_run(parent.data.tags["best.run_id"])
    evaluate = run_in_process([sys.executable, "-m", "recsys_runner.evaluate", f"load={trained.info.run_id}", *tracking], cwd)
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    (evaluated,) = client.search_runs([experiment_id], "tags.entry = 'evaluate'")
    exported = run_in_process([sys.executable, "-m", "recsys_runner.export", f"load={trained.info.run_id}", f"export.dir={cwd}/export",
                               "export.mlflow_model=true", *tracking], cwd)
    assert exported.returncode == 0, exported.stderr[-3000:]
    outputs = client.get_run(trained.info.run_id).outputs
    (model,) = outputs.model_outputs if outputs is not None else []
    (export_run,) = client.search_runs([experiment_id], "tags.entry = 'export'")
    return Logged(mlflow_server, experiment_id, parent, children, trained, evaluated, model.model_id, export_run,
                  sweep.stdout + sweep.stderr)


class Browser:
    """One headless chromium session and the few things the tests do with MLflow's pages."""

    def __init__(self, chromium: str, chromedriver: str, profile: Path, shots: list[Path]) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service

        options = Options()
        options.binary_location = chromium
        for flag in (*CHROME_FLAGS, f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}"):
            options.add_argument(flag)
        self.driver = webdriver.Chrome(options=options, service=Service(chromedriver))
        # the page's own size, not the window's: screenshots are exactly WINDOW
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                    {"width": WINDOW[0], "height": WINDOW[1], "deviceScaleFactor": 1, "mobile": False})
        self.shots = shots

    def open(self, url: str) -> None:
        self.driver.get(url)
        self.wait_for("MLflow's page", lambda: "Experiments" in self.text() or "Runs" in self.text())
        self.close_assistant()

    def wait_for(self, what: str, ready: Callable[[], Any], timeout: float = WAIT_S) -> Any:
        """``ready()``'s first truthy value, polled; fails naming ``what`` and showing the page's text."""
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.support.ui import WebDriverWait

        def poll(_: object) -> Any:
            try:
                return ready()
            except WebDriverException:  # the page re-rendered under us: poll again
                return None

        try:
            return WebDriverWait(self.driver, timeout, poll_frequency=0.25).until(poll)
        except Exception as e:
            raise AssertionError(f"waited {timeout:.0f} s for {what}; the page shows:\n{self.text()[:3000]}") from e

    def wait_text(self, *texts: str, timeout: float = WAIT_S) -> None:
        """Wait until the page shows every one of ``texts``; fails naming those it never showed."""
        missing: list[str] = list(texts)

        def shown() -> bool:
            page = self.text()
            missing[:] = [t for t in texts if t not in page]
            return not missing

        try:
            self.wait_for(f"{texts} on the page", shown, timeout)
        except AssertionError as e:
            raise AssertionError(f"never shown: {missing}; {e}") from None

    def text(self) -> str:
        return str(self.driver.execute_script("return document.body ? document.body.innerText : ''"))

    def click(self, xpath: str, what: str) -> None:
        """A real click (MLflow's tabs and selects answer pointer events, not a scripted ``click()``) on the first
        element ``xpath`` finds, once it shows."""
        from selenium.webdriver.common.by import By

        self.wait_for(what, lambda: self.driver.find_element(By.XPATH, xpath).is_displayed())
        self.driver.find_element(By.XPATH, xpath).click()

    def close_assistant(self) -> None:
        """MLflow 3.17's assistant panel opens itself on a first visit and takes a third of the page: close it."""
        self.driver.execute_script("document.querySelectorAll(\"button[aria-label='Close']\").forEach(b => b.click())")

    def rows(self) -> dict[str, dict[str, Any]]:
        """The runs table as rendered, top to bottom: run id → {column id: cell text}. ag-grid splits a row into its
        pinned and scrolled parts (one element each, the same row-id) and orders rows by position, not in the DOM."""
        return dict(self.driver.execute_script("""
            const rows = {};
            document.querySelectorAll('.ag-row[row-id]').forEach(r => {
              const cells = rows[r.getAttribute('row-id')] ??= {_index: Number(r.getAttribute('aria-rowindex'))};
              r.querySelectorAll('.ag-cell[col-id]').forEach(c => { cells[c.getAttribute('col-id')] = c.innerText.trim(); });
            });
            return rows;"""))

    def rows_with(self, *run_ids: str) -> dict[str, dict[str, Any]] | None:
        """:meth:`rows` once they include ``run_ids``, else ``None`` (for :meth:`wait_for`)."""
        rows = self.rows()
        return rows if set(run_ids) <= set(rows) else None

    def expand(self, run_id: str) -> None:
        """Click the +/- beside a run's name in the runs table (its nested runs show or hide)."""
        self.click(f"//div[contains(@class,'ag-row') and @row-id='{run_id}']//div[@col-id='{RUN_NAME_COL}']//button",
                   f"the expand button of run {run_id}")

    def show_columns(self, *names: str) -> None:
        """Tick ``names`` in the runs table's Columns selector, as a user does (MLflow 3 shows no param or metric
        column until then)."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys

        self.click("//button[normalize-space()='Columns']", "the Columns button")
        for name in names:
            search = self.wait_for("the column search box", lambda: self.driver.find_element(
                By.CSS_SELECTOR, "input[placeholder='Search columns']"))
            search.send_keys(Keys.CONTROL, "a")
            search.send_keys(Keys.BACKSPACE)
            search.send_keys(name)
            node = (f"//div[@data-testid='column-selector-tree']//div[contains(@class,'tree-treenode')]"
                    f"[.//span[contains(@class,'tree-title')][normalize-space(.)='{name}']]")
            self.click(node, f"column {name!r} in the Columns selector")
            checkbox = self.driver.find_element(By.XPATH, f"{node}//span[contains(@class,'tree-checkbox')]")
            if "checkbox-checked" not in (checkbox.get_attribute("class") or ""):
                checkbox.click()
        self.driver.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)

    def add_parallel_coordinates(self, params: list[str], metrics: list[str]) -> None:
        """Charts view: Add chart → Parallel coordinates, pick ``params`` and ``metrics``, add it."""
        from selenium.webdriver.common.keys import Keys

        self.click("(//button[normalize-space()='Add chart'])[1]", "the Add chart button")
        self.click("//*[@role='menuitem'][normalize-space()='Parallel coordinates']", "Parallel coordinates in Add chart")
        for field, names in (("Params", params), ("Metrics", metrics)):
            for name in names:
                self.click(f"//div[@role='dialog']//h4[normalize-space()='{field}']/following-sibling::div[1]",
                           f"the {field} select of the chart dialog")
                self.driver.switch_to.active_element.send_keys(name)  # the select filters its options as one types
                self.click(f"//div[contains(@class,'select-item-option')][@title='{name}']", f"{name!r} among the {field}")
                self.driver.switch_to.active_element.send_keys(Keys.ESCAPE)
        self.click("//button[@data-testid='experiment-view-compare-runs-chart-modal-confirm']", "the dialog's Add chart")

    def screenshot(self, name: str) -> None:
        for folder in self.shots:
            folder.mkdir(parents=True, exist_ok=True)
            self.driver.save_screenshot(str(folder / name))

    def quit(self) -> None:
        self.driver.quit()


@pytest.fixture(scope="module")
def browser(browser_binaries: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    shots = [tmp_path_factory.mktemp("screenshots")]
    if os.environ.get("RECSYS_UI_SCREENSHOTS"):
        shots.append(Path(os.environ["RECSYS_UI_SCREENSHOTS"]))
    session = Browser(*browser_binaries, tmp_path_factory.mktemp("chromium_profile"), shots)
    try:
        yield session
    finally:
        session.quit()


def _ui_url(logged: Logged, run_id: str | None = None) -> str:
    from recsys_runner.tracking.store import ui_url

    return str(ui_url(logged.uri, logged.experiment_id, run_id))


def test_the_experiment_opens_on_its_training_runs(logged: Logged, browser: Browser) -> None:
    """The runner's URL opens the runs table, not MLflow 3's GenAI overview (traces, latency, tokens): MLflow 3.17's UI
    takes the view from the URL's ``workflowType`` (the experiment-kind tag is read only on Databricks)."""
    url = _ui_url(logged)
    assert "workflowType=machine_learning" in url, url
    browser.open(url)
    browser.wait_text("Run Name", logged.parent.info.run_name)
    page = browser.text()
    for genai in ("Token Usage", "Latency", "No data available"):
        assert genai not in page, f"{genai!r}: the GenAI overview, not the runs\n{page[:2000]}"


def test_runs_table_lists_the_sweeps_children_with_params_auc_and_dataset(logged: Logged, browser: Browser) -> None:
    browser.open(_ui_url(logged))
    browser.wait_text(logged.parent.info.run_name)
    browser.show_columns("swept.optim.lr", "eval/auc")
    children = {r.info.run_id: r for r in logged.children}
    if not set(children) <= set(browser.rows()):  # the sweep is one collapsed parent row until expanded
        browser.expand(logged.parent.info.run_id)
    rows = browser.wait_for("the sweep's children in the runs table", lambda: browser.rows_with(*children))
    assert {rows[i][SWEPT_COL] for i in children} == set(LRS), rows
    for run_id, run in children.items():
        row = rows[run_id]
        assert row[RUN_NAME_COL].endswith(f"lr={run.data.params['swept.optim.lr']}"), row
        assert float(row[AUC_COL]) == pytest.approx(run.data.metrics["eval/auc"], abs=1e-3), row
        assert row[DATASET_COL] not in ("", "-"), f"no dataset shown for {row[RUN_NAME_COL]}: {row}"
    models = {run_id: rows[run_id].get(MODELS_COL, "") for run_id in children}
    assert models.pop(logged.trained.info.run_id) not in ("", "-"), f"the exported model is not in the Models column: {rows}"
    assert set(models.values()) <= {"", "-"}, f"a model shown for a run that exported none: {rows}"
    browser.screenshot("ui_runs_table.png")


PLOTTED_JS = """
const dialog = [...document.querySelectorAll('[role=dialog]')].find(d => d.innerText.includes('Parallel Coordinates'));
const plot = dialog && dialog.querySelector('.parcoords');
const canvas = dialog && dialog.querySelector('canvas.foreground');
if (!plot || !canvas || !canvas.width) return null;
let fiber = plot[Object.keys(plot).find(k => k.startsWith('__reactFiber'))];
while (fiber && !Array.isArray((fiber.memoizedProps || {}).data)) fiber = fiber.return;
const {width, height} = canvas;
const alpha = canvas.getContext('2d').getImageData(0, 0, width, height).data;
const drawn = (x, y) => alpha[(y * width + x) * 4 + 3] > 0;
const columns = [...Array(width).keys()].filter(x => [...Array(height).keys()].some(y => drawn(x, y)));
if (!columns.length) return null;
const x = Math.round(columns[0] + 0.1 * (columns[columns.length - 1] - columns[0]));
let lines = 0;
for (let y = 0; y < height; y++) if (drawn(x, y) && (y === 0 || !drawn(x, y - 1))) lines++;
return {rows: fiber ? fiber.memoizedProps.data : null, lines: lines};
"""
"""In the full-screen parallel-coordinates chart: the rows its plot component draws (``{uuid, <param>, <metric>}`` each, the
``data`` prop MLflow's ParallelCoordinatesPlot is given, read from React) and how many lines its canvas shows (separate
strokes crossing a column a tenth of the way from the first axis to the last); ``None`` until it has drawn."""


def test_sweep_chart_view_plots_each_child(logged: Logged, browser: Browser) -> None:
    """The charts view draws the children, and a parallel-coordinates chart of the swept value against eval/auc has one
    line per child (the sweep expanded as in the table): each child's run, its swept value and its eval/auc among the
    chart's rows, and as many lines drawn on its canvas as there are children."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.open(_ui_url(logged))
    browser.wait_text(logged.parent.info.run_name)
    children = {r.info.run_id: r for r in logged.children}
    if not set(children) <= set(browser.rows()):
        browser.expand(logged.parent.info.run_id)
    browser.wait_for("the children in the runs table", lambda: set(children) <= set(browser.rows()))
    browser.click("//label[.//input[@name='runs-view-mode' and @value='CHART']]", "the chart view toggle")
    browser.wait_text("eval/auc", *(r.info.run_name for r in logged.children))
    # the UI's parallel-coordinates chart needs the same swept.* key in every child: one axis per swept key
    browser.add_parallel_coordinates(["swept.optim.lr"], ["eval/auc"])
    card = "//div[@data-testid='experiment-view-compare-runs-card'][.//h4[@title='Parallel Coordinates']]"
    browser.click(f"{card}//button[@data-component-id='fullscreen_button_chartcard']", "the chart's full-screen button")
    browser.wait_for("the parallel-coordinates chart, full screen, with an axis per swept key and metric",
                     lambda: browser.driver.execute_script(
                         "return [...document.querySelectorAll('[role=dialog]')].some(d => ['Parallel Coordinates',"
                         " 'swept.optim.lr', 'eval/auc'].every(t => d.innerText.includes(t)))"))
    children = {r.info.run_id: r for r in logged.children}
    seen: list[Any] = [None]

    def drawn_all() -> bool:  # the canvas may draw after the dialog shows: poll a while, then check what was last seen
        seen[0] = browser.driver.execute_script(PLOTTED_JS)
        return bool(seen[0]) and seen[0]["lines"] >= len(children) and len(seen[0]["rows"] or []) >= len(children)

    # WAIT_S, not seconds: the canvas draws in a browser sharing 2 loaded cores with the other pytest worker; a chart
    # that has drawn all its lines ends the wait at once, and only one that never does waits it out before the asserts
    with contextlib.suppress(AssertionError):
        browser.wait_for("every child's line", drawn_all)
    plotted = seen[0]
    assert plotted, "the parallel-coordinates chart drew nothing"
    rows = {row["uuid"]: (row.get("swept.optim.lr"), row.get("eval/auc")) for row in plotted["rows"] or []}
    assert set(rows) == set(children), f"the chart's runs are not the sweep's children: {plotted}"
    assert sorted(lr for lr, _ in rows.values()) == sorted(LRS), plotted
    for run_id, (lr, auc) in rows.items():
        logged_run = children[run_id].data
        assert lr == logged_run.params.get("swept.optim.lr") and auc == pytest.approx(logged_run.metrics.get("eval/auc")), plotted
    assert plotted["lines"] == len(children), f"{plotted['lines']} lines drawn for {len(children)} children"
    browser.screenshot("ui_sweep_chart.png")
    browser.driver.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)


def test_run_page_shows_dataset_digest_source_commit_params_and_charts(logged: Logged, browser: Browser) -> None:
    run = logged.trained
    browser.open(_ui_url(logged, run.info.run_id))
    browser.wait_text(run.info.run_name, "Datasets", "Parameters")
    (dataset_input, *_) = [d for d in run.inputs.dataset_inputs]
    commit = run.data.tags["mlflow.source.git.commit"]
    browser.wait_text(dataset_input.dataset.digest, commit[:7], "swept.optim.lr", "optim.lr", "eval/auc")
    model = MlflowClient(tracking_uri=logged.uri).get_logged_model(logged.model_id)
    browser.wait_text("Logged models", model.name)  # the export's model, an output of this training run
    browser.screenshot("ui_run_page.png")
    browser.click("//*[@role='tab' or self::button or self::a][normalize-space()='Model metrics']", "the Model metrics tab")
    browser.wait_for("metric charts on the run page", lambda: browser.driver.execute_script(
        "return document.querySelectorAll('.js-plotly-plot').length"))
    # one section of charts per metric prefix (those below the fold are drawn when scrolled to)
    browser.wait_for("the run's train and eval chart sections", lambda: {"train", "eval"} <= set(browser.text().splitlines()))
    browser.wait_text("eval/auc")


def test_evaluate_run_is_nested_under_its_training_run(logged: Logged, browser: Browser) -> None:
    """The evaluate run is a child of the training run whose checkpoint it loaded: in the runs table (under that run, itself
    under the sweep, beside the export run) and on both runs' pages."""
    trained, evaluated = logged.trained, logged.evaluated
    assert evaluated.data.tags.get("mlflow.parentRunId") == trained.info.run_id, evaluated.data.tags
    browser.open(_ui_url(logged))
    browser.wait_text(logged.parent.info.run_name)
    if trained.info.run_id not in browser.rows():
        browser.expand(logged.parent.info.run_id)
    browser.wait_for("the training run in the table", lambda: trained.info.run_id in browser.rows())
    if evaluated.info.run_id not in browser.rows():
        browser.expand(trained.info.run_id)
    browser.wait_for("the evaluate run under the training run", lambda: evaluated.info.run_id in browser.rows())
    rows = browser.rows()
    below = {rows[run_id]["_index"] for run_id in (evaluated.info.run_id, logged.exported.info.run_id)}
    assert below == {rows[trained.info.run_id]["_index"] + 1, rows[trained.info.run_id]["_index"] + 2}, rows  # its two children
    browser.open(_ui_url(logged, trained.info.run_id))
    browser.wait_text("Child runs", evaluated.info.run_name)
    browser.open(_ui_url(logged, evaluated.info.run_id))
    browser.wait_text("Parent run", trained.info.run_name)
