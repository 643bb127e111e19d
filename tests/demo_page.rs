//! The demo chat page (`GET /demo`, `[demo] page`), which runs on the TypeScript SDK
//! (`sdk/typescript`, bundled as `/demo/converger.js`): in headless Chromium, behind a TCP proxy
//! that can cut the connection, a question typed into the page gets an answer that streams in,
//! survives a reload mid-stream without doubling a word, and ends as the stored answer; a
//! question whose ack is lost in a cut is resent by the SDK under its clientId and stored once.
//! The screenshot is kept in `target/test-artifacts/demo-page.png`.

mod support;

use serde_json::json;
use support::TestNode;
use support::browser::Browser;
use support::proxy::Proxy;
use support::ws::WsClient;

/// The texts of the page's bubbles of `role` ("user" or "agent"), joined with `|`.
fn bubbles(role: &str) -> String {
    format!("[...document.querySelectorAll('.{role}')].map(b => b.textContent).join('|')")
}

/// Types `question` into the page and submits it.
async fn ask(browser: &mut Browser, question: &str) {
    let question = serde_json::to_string(question).unwrap();
    browser
        .evaluate(&format!(
            "document.getElementById('text').value = {question}; \
             document.getElementById('send').requestSubmit(); true"
        ))
        .await;
}

/// The agent's next delivered turn, which must be `question`: (conversation id, seq).
async fn delivered(agent: &mut WsClient, question: &str) -> (serde_json::Value, i64) {
    loop {
        let delivered = agent.recv().await;
        if let Some(seq) = delivered["frame"]["meta"]["turn"]["seq"].as_i64() {
            assert_eq!(delivered["frame"]["data"]["text"], question);
            return (delivered["conversationId"].clone(), seq);
        }
    }
}

#[tokio::test]
async fn the_demo_page_is_off_unless_asked_for_outside_development() {
    // The test nodes have a database URL: "auto" is off there, as in production.
    let node = TestNode::start().await;
    for path in ["/demo", "/demo/converger.js"] {
        let page = node.http.get(node.url(path)).send().await.unwrap();
        assert_eq!(page.status(), 404, "{path}");
    }
    let created = node
        .http
        .post(node.url("/demo/api/conversation"))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 404);
}

#[tokio::test]
async fn the_demo_page_streams_survives_a_reload_and_resends_after_a_cut() {
    let node = TestNode::start_with(|config| {
        config.group_settle_ms = 100;
        config.demo.page = converger_gateway::config::DemoPage::On;
    })
    .await;
    let refused = node
        .http
        .post(node.url("/demo/api/agent-token"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        refused.status(),
        401,
        "the agent token needs the admin token"
    );
    let agent_token: serde_json::Value = node
        .http
        .post(node.url("/demo/api/agent-token"))
        .bearer_auth(&node.admin_token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let (mut agent, welcome) = node
        .agent(agent_token["token"].as_str().unwrap(), Some("demo"))
        .await;
    support::settle(&welcome).await;

    let bundle = node
        .http
        .get(node.url("/demo/converger.js"))
        .send()
        .await
        .unwrap();
    assert_eq!(bundle.status(), 200);
    assert!(bundle.text().await.unwrap().contains("var Converger"));

    // The browser reaches the node only through the proxy, so a cut is a real lost connection.
    let proxy = Proxy::start(node.server.addr()).await;
    let mut browser = Browser::launch().await;
    browser.navigate(&proxy.url("/demo")).await;
    browser
        .wait_for("document.body.dataset.ready === '1'")
        .await;
    ask(&mut browser, "Tell me about streams").await;
    let (conversation, seq) = delivered(&mut agent, "Tell me about streams").await;
    let words = ["Streams ", "arrive ", "word ", "by ", "word."];
    let chunk = |index: usize| {
        support::stream_chunk(
            conversation.as_str().unwrap(),
            "demo-1",
            index as u64,
            seq,
            words[index],
        )
    };
    for index in 0..3 {
        agent.send(chunk(index)).await;
    }
    browser
        .wait_for("document.querySelector('.streaming')?.textContent === 'Streams arrive word '")
        .await;

    // Reload mid-stream: the page reconnects with the same conversation and shows the stream
    // so far, once.
    browser.navigate(&proxy.url("/demo")).await;
    browser
        .wait_for("document.body.dataset.ready === '1'")
        .await;
    browser
        .wait_for("document.querySelector('.streaming')?.textContent === 'Streams arrive word '")
        .await;
    for index in 3..5 {
        agent.send(chunk(index)).await;
    }
    agent
        .send(json!({"conversationId": conversation, "frame": {
            "type": "turnResult", "clientId": "r-1", "turn": {"seq": seq},
            "frames": [{"type": "text", "streamId": "demo-1",
                        "data": {"text": "Streams arrive word by word."}}]}}))
        .await;
    browser
        .wait_for(&format!(
            "document.querySelector('.streaming') === null && {} === 'Streams arrive word by word.'",
            bubbles("agent")
        ))
        .await;
    let users = browser.evaluate(&bubbles("user")).await;
    assert_eq!(users, json!("Tell me about streams"), "one question bubble");

    // A second question whose ack never reaches the page: the node stores it and hands the turn
    // to the agent, but the page still shows it pending when the connection is cut.
    proxy.hold_downstream();
    ask(&mut browser, "Are you still there?").await;
    let (_, second) = delivered(&mut agent, "Are you still there?").await;
    let pending = browser
        .evaluate("document.querySelector('.user.pending')?.textContent ?? null")
        .await;
    assert_eq!(
        pending,
        json!("Are you still there?"),
        "the ack was held back"
    );
    proxy.cut();
    proxy.release_downstream();

    // The SDK reconnects and resends the send under its clientId: the node acks the stored frame
    // (a duplicate) and the bubble settles; nothing is stored twice.
    browser
        .wait_for(&format!(
            "document.querySelector('.pending') === null && {} === \
             'Tell me about streams|Are you still there?'",
            bubbles("user")
        ))
        .await;
    let token = browser
        .evaluate("JSON.parse(localStorage.getItem('converger-demo')).token")
        .await;
    let conversation_id = conversation.as_str().unwrap().parse().unwrap();
    let (status, page) = node
        .activities(conversation_id, token.as_str().unwrap(), "")
        .await;
    assert_eq!(status, 200, "{page}");
    let questions: Vec<String> = support::page_texts(&page)
        .into_iter()
        .filter(|text| text == "Are you still there?")
        .collect();
    assert_eq!(questions.len(), 1, "stored once: {page}");

    agent
        .send(json!({"conversationId": conversation, "frame": {
            "type": "turnResult", "clientId": "r-2", "turn": {"seq": second},
            "frames": [{"type": "text", "data": {"text": "Still here."}}]}}))
        .await;
    browser
        .wait_for(&format!(
            "{} === 'Streams arrive word by word.|Still here.'",
            bubbles("agent")
        ))
        .await;

    browser.keep_screenshot("demo-page.png").await;
}
