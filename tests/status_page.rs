//! The status page at `GET /`: admin token required, then nodes, channels with their groups and
//! members, and this node's figures, server-rendered. Checked over HTTP and in headless Chromium
//! (Debian's `chromium`, installed by `.ci/test-prerequisites`, driven over DevTools), whose
//! screenshot is kept in `target/test-artifacts/status-page.png`.

mod support;

use support::TestNode;
use support::browser::Browser;

/// The headers every status page answer carries.
fn assert_page_headers(headers: &reqwest::header::HeaderMap) {
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"));
    assert_eq!(headers["x-frame-options"], "DENY");
    assert_eq!(headers["referrer-policy"], "no-referrer");
    assert_eq!(headers["cache-control"], "no-store");
}

#[tokio::test]
async fn the_status_page_needs_the_admin_token_and_shows_the_cluster() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let agent_token = node.agent_token(&acme).await;
    let (member, welcome) = node.agent(&agent_token, Some("support-bots")).await;
    let connection_id = welcome["data"]["connectionId"].as_str().unwrap().to_owned();
    let no_redirects = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();

    // Without the token: 401 and a form that posts it; a wrong token is refused the same way,
    // and a token in the URL logs nobody in.
    let refused = no_redirects.get(node.url("/")).send().await.unwrap();
    assert_eq!(refused.status(), 401);
    assert_page_headers(refused.headers());
    let form = refused.text().await.unwrap();
    assert!(form.contains("method=\"post\"") && form.contains("name=\"token\""));
    let in_url = no_redirects
        .get(node.url(&format!("/?token={}", node.admin_token)))
        .send()
        .await
        .unwrap();
    assert_eq!(in_url.status(), 401);
    assert!(in_url.headers().get("set-cookie").is_none());
    let wrong = no_redirects
        .post(node.url("/"))
        .form(&[("token", "not-the-token")])
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);

    // The posted token becomes an HttpOnly cookie, then the page renders from it; Secure when
    // the request came through a TLS proxy.
    let login = no_redirects
        .post(node.url("/"))
        .form(&[("token", node.admin_token.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), 303);
    let cookie = login.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"));
    assert!(!cookie.contains("Secure"));
    let behind_tls = no_redirects
        .post(node.url("/"))
        .header("x-forwarded-proto", "https")
        .form(&[("token", node.admin_token.as_str())])
        .send()
        .await
        .unwrap();
    assert!(
        behind_tls.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("; Secure")
    );
    let page = no_redirects
        .get(node.url("/"))
        .header("cookie", cookie.split(';').next().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    assert_page_headers(page.headers());
    let html = page.text().await.unwrap();
    for expected in [
        node.server.state().hub.node_id(),
        "acme-web",
        "support-bots",
        connection_id.as_str(),
        "http-equiv=\"refresh\"",
    ] {
        assert!(html.contains(expected), "the page shows {expected}");
    }
    // A bearer header works as well (curl).
    let with_bearer = reqwest::Client::new()
        .get(node.url("/"))
        .bearer_auth(&node.admin_token)
        .send()
        .await
        .unwrap();
    assert_eq!(with_bearer.status(), 200);

    // In a real browser: the login form posts the token, the redirect keeps the cookie, and the
    // DOM holds the cluster; the screenshot is kept for people to look at.
    let mut browser = Browser::launch().await;
    browser.navigate(&node.url("/")).await;
    browser
        .evaluate(&format!(
            "document.querySelector('input[name=token]').value = {}; document.forms[0].submit(); true",
            serde_json::to_string(&node.admin_token).unwrap()
        ))
        .await;
    browser
        .wait_for("document.querySelector('#nodes') !== null")
        .await;
    let dom = browser.html().await;
    assert!(dom.contains("support-bots") && dom.contains(&connection_id));
    assert!(
        dom.contains("class=\"self\""),
        "this node is marked as self"
    );
    browser.keep_screenshot("status-page.png").await;
    member.close().await;
}
