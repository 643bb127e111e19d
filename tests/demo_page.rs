//! The demo chat page (`GET /demo`, `[demo] page`): in headless Chromium, a question typed into
//! the page gets an answer that streams in, survives a reload mid-stream without doubling a
//! word, and ends as the stored answer. The screenshot is kept in
//! `target/test-artifacts/demo-page.png`.

mod support;

use serde_json::json;
use support::TestNode;
use support::browser::Browser;

#[tokio::test]
async fn the_demo_page_is_off_unless_asked_for_outside_development() {
    // The test nodes have a database URL: "auto" is off there, as in production.
    let node = TestNode::start().await;
    let page = node.http.get(node.url("/demo")).send().await.unwrap();
    assert_eq!(page.status(), 404);
    let created = node
        .http
        .post(node.url("/demo/api/conversation"))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 404);
}

#[tokio::test]
async fn a_streamed_answer_survives_a_reload_of_the_demo_page() {
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

    let mut browser = Browser::launch().await;
    browser.navigate(&node.url("/demo")).await;
    browser
        .wait_for("document.body.dataset.ready === '1'")
        .await;
    browser
        .evaluate(
            "document.getElementById('text').value = 'Tell me about streams'; \
             document.getElementById('send').requestSubmit(); true",
        )
        .await;
    let (conversation, seq) = loop {
        let delivered = agent.recv().await;
        if let Some(seq) = delivered["frame"]["meta"]["turn"]["seq"].as_i64() {
            assert_eq!(delivered["frame"]["data"]["text"], "Tell me about streams");
            break (delivered["conversationId"].clone(), seq);
        }
    };
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
    browser.navigate(&node.url("/demo")).await;
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
        .wait_for(
            "document.querySelector('.streaming') === null && \
             [...document.querySelectorAll('.agent')].map(b => b.textContent).join('|') \
               === 'Streams arrive word by word.'",
        )
        .await;
    let users = browser
        .evaluate("[...document.querySelectorAll('.user')].map(b => b.textContent)")
        .await;
    assert_eq!(
        users,
        json!(["Tell me about streams"]),
        "one question bubble"
    );

    browser.keep_screenshot("demo-page.png").await;
}
