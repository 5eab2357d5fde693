//! Lists that page by a registry's own token: tag lists and the catalog
//! follow each page's `Link` (Quay's opaque `next_page`, which reads `last`
//! as a token and so answers the first page again), so retention's tag
//! lists, the catalog and the usage records see every entry.

mod common;

use common::fixtures::Image;
use common::front::{Front, Mode};
use common::{TestRegistry, push_image, push_manifest};
use pinswap::reference::Reference;
use pinswap::registry::{ClientPool, PoolOptions, Role};

#[tokio::test]
async fn token_paged_tags_and_catalog_are_read_whole() {
    common::init();
    let reg = TestRegistry::plain().await;
    let img = Image::oci(1, 7);
    let mut tags: Vec<String> = (0..250).map(|i| format!("t{i:03}")).collect();
    push_image(&reg, "shop/app", Some(&tags[0]), &img).await;
    for t in &tags[1..] {
        push_manifest(&reg, "shop/app", t, &img.media_type, &img.manifest).await;
    }
    let mut repos: Vec<String> = (0..129).map(|i| format!("r{i:03}/app")).collect();
    for r in &repos {
        push_image(&reg, r, Some("v1"), &img).await;
    }
    repos.push("shop/app".into());
    repos.sort();
    tags.sort();

    let front = Front::start(&reg.host()).await;
    front.set(Mode::TokenPages(100, None));
    let pool = ClientPool::new(PoolOptions {
        insecure: vec![front.host()],
        ..PoolOptions::default()
    });
    let client = pool.get(&front.host(), Role::Target).await.unwrap();
    let r = Reference::parse(&format!("{}/shop/app:t000", front.host())).unwrap();

    let mut got = client.tags(&r).await.unwrap();
    got.sort();
    assert_eq!(got, tags);
    let mut got = client.catalog().await.unwrap();
    got.sort();
    assert_eq!(got, repos);
    // Three pages of tags and two of the catalog, each next one the page's
    // own link.
    let lists: Vec<String> = front
        .requests()
        .into_iter()
        .map(|(_, p)| p)
        .filter(|p| p.contains("/tags/list") || p.contains("/_catalog"))
        .collect();
    assert_eq!(
        lists,
        [
            "/v2/shop/app/tags/list?n=1000",
            "/v2/shop/app/tags/list?n=100&next_page=opaque-64",
            "/v2/shop/app/tags/list?n=100&next_page=opaque-c8",
            "/v2/_catalog?n=1000",
            "/v2/_catalog?n=100&next_page=opaque-64",
        ]
    );
}

/// A registry that writes links under its public name, while pinswap
/// reaches it by another, is still asked for each next page itself; a link
/// to another list is refused.
#[tokio::test]
async fn next_pages_are_asked_of_the_registry_and_only_for_the_same_list() {
    common::init();
    let reg = TestRegistry::plain().await;
    let img = Image::oci(1, 9);
    let tags: Vec<String> = (0..150).map(|i| format!("t{i:03}")).collect();
    push_image(&reg, "shop/app", Some(&tags[0]), &img).await;
    for t in &tags[1..] {
        push_manifest(&reg, "shop/app", t, &img.media_type, &img.manifest).await;
    }
    let front = Front::start(&reg.host()).await;
    let pool = ClientPool::new(PoolOptions {
        insecure: vec![front.host()],
        ..PoolOptions::default()
    });
    let client = pool.get(&front.host(), Role::Target).await.unwrap();
    let r = Reference::parse(&format!("{}/shop/app:t000", front.host())).unwrap();

    front.set(Mode::TokenPages(
        100,
        Some("https://quay.example.invalid/v2/shop/app/tags/list"),
    ));
    let mut got = client.tags(&r).await.unwrap();
    got.sort();
    assert_eq!(got, tags);
    assert_eq!(
        front.count_exact("GET", "/v2/shop/app/tags/list?n=100&next_page=opaque-64"),
        1
    );

    front.set(Mode::TokenPages(100, Some("/v2/other/app/tags/list")));
    let e = client.tags(&r).await.unwrap_err().to_string();
    assert!(e.contains("a next page of another list"), "{e}");
    assert_eq!(front.count("/v2/other/"), 0);
}
