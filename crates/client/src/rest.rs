//! Typed calls of the REST surface.

use reqwest::{Method, RequestBuilder};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::error::ClientError;

/// `POST /api/v1/admin/tenants` answer.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreatedTenant {
    /// Tenant id.
    pub id: Uuid,
    /// Name.
    pub name: String,
    /// The API key, shown only once.
    pub api_key: String,
}

/// A channel as listed.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ChannelInfo {
    /// Channel id.
    pub id: Uuid,
    /// Name.
    pub name: String,
    /// `active` or `inactive`.
    pub status: String,
}

/// `POST /api/v1/channels` answer.
#[derive(Debug, Clone, Deserialize)]
pub struct CreatedChannel {
    /// Channel id.
    pub id: Uuid,
    /// Name.
    pub name: String,
    /// The channel secret, shown only once.
    pub secret: String,
    /// `active`.
    pub status: String,
}

/// Body of `POST /api/v1/converger/tokens/generate`.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenRequest {
    /// `{id}` of the verified end user.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<Value>,
    /// `conversation` or `channel`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// Bind the token to this conversation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<Uuid>,
}

impl TokenRequest {
    /// A conversation-scope request for a verified user.
    pub fn for_user(user_id: &str) -> TokenRequest {
        TokenRequest {
            user: Some(json!({"id": user_id})),
            ..TokenRequest::default()
        }
    }

    /// A channel-scope (agent) request.
    pub fn channel_scope() -> TokenRequest {
        TokenRequest {
            scope: Some("channel".into()),
            ..TokenRequest::default()
        }
    }
}

/// A token and its lifetime.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenResponse {
    /// The JWT.
    pub token: String,
    /// Seconds until expiry.
    pub expires_in: i64,
}

/// `POST /api/v1/converger/conversations` answer.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreatedConversation {
    /// The new conversation.
    pub conversation_id: Uuid,
    /// Its end user.
    pub user_id: String,
    /// A token bound to it.
    pub token: String,
    /// Seconds until the token expires.
    #[serde(rename = "expires_in")]
    pub expires_in: i64,
}

/// `POST …/activities` answer.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Posted {
    /// Activity id.
    pub id: String,
    /// Its seq.
    pub seq: i64,
}

/// One page of `GET …/activities`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ActivitiesPage {
    /// Persistent frames in seq order.
    pub activities: Vec<Value>,
    /// The last seq of this page (the request's watermark when empty).
    pub watermark: i64,
    /// Whether another page follows.
    pub has_more: bool,
}

/// A REST client bound to one node's base URL.
///
/// ```no_run
/// use converger_client::{RestClient, TokenRequest};
///
/// # async fn run() -> Result<(), converger_client::ClientError> {
/// let rest = RestClient::new("http://127.0.0.1:8080")?;
/// let token = rest
///     .generate_token("<channel secret>", &TokenRequest::for_user("alice"))
///     .await?
///     .token;
/// let created = rest.create_conversation(&token).await?;
/// println!("conversation {} for {}", created.conversation_id, created.user_id);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RestClient {
    base_url: String,
    http: reqwest::Client,
}

impl RestClient {
    /// A client for `base_url` (e.g. `http://127.0.0.1:8080`) with a 10 s request timeout.
    pub fn new(base_url: impl Into<String>) -> Result<RestClient, ClientError> {
        let http = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(10))
            .build()?;
        Ok(RestClient {
            base_url: base_url.into().trim_end_matches('/').to_owned(),
            http,
        })
    }

    fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base_url))
    }

    /// Creates a tenant with the admin token.
    pub async fn create_tenant(
        &self,
        admin_token: &str,
        name: &str,
    ) -> Result<CreatedTenant, ClientError> {
        let request = self
            .request(Method::POST, "/api/v1/admin/tenants")
            .bearer_auth(admin_token);
        send(request.json(&json!({"name": name}))).await
    }

    /// Creates a channel of the API key's tenant.
    pub async fn create_channel(
        &self,
        api_key: &str,
        name: &str,
    ) -> Result<CreatedChannel, ClientError> {
        let request = self
            .request(Method::POST, "/api/v1/channels")
            .header("x-api-key", api_key);
        send(request.json(&json!({"name": name}))).await
    }

    /// Lists the API key's tenant's channels.
    pub async fn list_channels(&self, api_key: &str) -> Result<Vec<ChannelInfo>, ClientError> {
        #[derive(Deserialize)]
        struct Listing {
            channels: Vec<ChannelInfo>,
        }
        let request = self
            .request(Method::GET, "/api/v1/channels")
            .header("x-api-key", api_key);
        let listing: Listing = send(request).await?;
        Ok(listing.channels)
    }

    /// Sets a channel `active` or `inactive`.
    pub async fn set_channel_status(
        &self,
        api_key: &str,
        channel_id: Uuid,
        status: &str,
    ) -> Result<ChannelInfo, ClientError> {
        let request = self
            .request(Method::PATCH, &format!("/api/v1/channels/{channel_id}"))
            .header("x-api-key", api_key);
        send(request.json(&json!({"status": status}))).await
    }

    /// Issues a token with a channel secret.
    pub async fn generate_token(
        &self,
        secret: &str,
        body: &TokenRequest,
    ) -> Result<TokenResponse, ClientError> {
        let request = self
            .request(Method::POST, "/api/v1/converger/tokens/generate")
            .bearer_auth(secret);
        send(request.json(body)).await
    }

    /// Exchanges a valid token for a fresh one with the same claims.
    pub async fn refresh_token(&self, token: &str) -> Result<TokenResponse, ClientError> {
        send(
            self.request(Method::POST, "/api/v1/converger/tokens/refresh")
                .bearer_auth(token),
        )
        .await
    }

    /// Creates a conversation in the token's channel.
    pub async fn create_conversation(
        &self,
        token: &str,
    ) -> Result<CreatedConversation, ClientError> {
        send(
            self.request(Method::POST, "/api/v1/converger/conversations")
                .bearer_auth(token),
        )
        .await
    }

    /// Posts a message frame, optionally with an idempotency key.
    pub async fn post_activity(
        &self,
        token: &str,
        conversation_id: Uuid,
        frame: &Value,
        idempotency_key: Option<&str>,
    ) -> Result<Posted, ClientError> {
        let path = format!("/api/v1/converger/conversations/{conversation_id}/activities");
        let mut request = self
            .request(Method::POST, &path)
            .bearer_auth(token)
            .json(frame);
        if let Some(key) = idempotency_key {
            request = request.header("x-idempotency-key", key);
        }
        send(request).await
    }

    /// Reads frames after `watermark`, at most `limit` (≤ 1000).
    pub async fn list_activities(
        &self,
        token: &str,
        conversation_id: Uuid,
        watermark: i64,
        limit: i64,
    ) -> Result<ActivitiesPage, ClientError> {
        let path = format!(
            "/api/v1/converger/conversations/{conversation_id}/activities?watermark={watermark}&limit={limit}"
        );
        send(self.request(Method::GET, &path).bearer_auth(token)).await
    }
}

async fn send<T: DeserializeOwned>(request: RequestBuilder) -> Result<T, ClientError> {
    let response = request.send().await?;
    let status = response.status();
    if status.is_success() {
        return Ok(response.json::<T>().await?);
    }
    let body: Value = response.json().await.unwrap_or(Value::Null);
    let code = body["error"]["code"]
        .as_str()
        .unwrap_or("unknown")
        .to_owned();
    let message = body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    Err(ClientError::Api {
        status,
        code,
        message,
    })
}
